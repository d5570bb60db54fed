"""Image backbones in plain torch, ending in ORCA's normalised head.

* :func:`resnet18` — ResNet-18 for 32×32 inputs (3×3 stem, stride 1, no max-pool; the CIFAR
  variant the paper and its reference code use), 512-d features, 11.17 M parameters;
* :func:`resnet50` — ResNet-50 for 224×224 inputs (7×7 stem, max-pool; ImageNet-100), 2048-d;
* :class:`SmallCNN` — three conv blocks, 128-d, for CPU-sized checks (digits, a CIFAR subset).

Every backbone names its blocks ``layer1`` … and exposes ``out_dim`` and ``last_block``, so
:func:`freeze_all_but_last_block` works on each (paper App. A: "we only update the parameters of
the last block of ResNet in the second training stage").
"""

from __future__ import annotations

import torch
from torch import nn

from ..module import NormedLinear

ARCHS = ("small", "resnet18", "resnet50")


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = _shortcut(c_in, c_out, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, c_in: int, width: int, stride: int = 1) -> None:
        super().__init__()
        c_out = width * self.expansion
        self.conv1 = nn.Conv2d(c_in, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, c_out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(c_out)
        self.shortcut = _shortcut(c_in, c_out, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = torch.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return torch.relu(out + self.shortcut(x))


def _shortcut(c_in: int, c_out: int, stride: int) -> nn.Module:
    if stride == 1 and c_in == c_out:
        return nn.Identity()
    return nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))


class ResNet(nn.Module):
    """ResNet without its classifier: ``(B, C, H, W) -> (B, out_dim)`` after global average pooling."""

    def __init__(
        self, block: type, layers: tuple[int, ...], *, small_input: bool, in_channels: int = 3
    ) -> None:
        super().__init__()
        if small_input:  # 32×32: keep the resolution in the stem
            self.stem = nn.Sequential(
                nn.Conv2d(in_channels, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU()
            )
        else:
            self.stem = nn.Sequential(
                nn.Conv2d(in_channels, 64, 7, 2, 3, bias=False),
                nn.BatchNorm2d(64),
                nn.ReLU(),
                nn.MaxPool2d(3, 2, 1),
            )
        c_in = 64
        for i, (width, n) in enumerate(zip((64, 128, 256, 512), layers, strict=True)):
            blocks = []
            for j in range(n):
                stride = 2 if (i > 0 and j == 0) else 1
                blocks.append(block(c_in, width, stride))
                c_in = width * block.expansion
            setattr(self, f"layer{i + 1}", nn.Sequential(*blocks))
        self.out_dim = c_in
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    @property
    def last_block(self) -> nn.Module:
        return self.layer4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1)


class SmallCNN(nn.Module):
    """Three blocks of conv 3×3 -> BatchNorm -> ReLU, each of the first two followed by a 2×2
    max-pool while the feature map is at least 8 px; global average pooling; ``out_dim = 128``
    (about 0.1 M parameters, 10 M multiply-adds per 32×32 image: CPU-sized).
    """

    def __init__(self, in_channels: int = 3, widths: tuple[int, int, int] = (32, 64, 128)) -> None:
        super().__init__()
        c = in_channels
        for i, w in enumerate(widths):
            block = nn.Sequential(
                nn.Conv2d(c, w, 3, 1, 1, bias=False), nn.BatchNorm2d(w), nn.ReLU()
            )
            setattr(self, f"layer{i + 1}", block)
            c = w
        self.n_blocks = len(widths)
        self.out_dim = c

    @property
    def last_block(self) -> nn.Module:
        return getattr(self, f"layer{self.n_blocks}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(1, self.n_blocks + 1):
            x = getattr(self, f"layer{i}")(x)
            if i < self.n_blocks and min(x.shape[-2:]) >= 8:
                x = nn.functional.max_pool2d(x, 2)
        return torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1)


def resnet18(in_channels: int = 3) -> ResNet:
    """ResNet-18 for 32×32 images (CIFAR stem)."""
    return ResNet(BasicBlock, (2, 2, 2, 2), small_input=True, in_channels=in_channels)


def resnet50(in_channels: int = 3) -> ResNet:
    """ResNet-50 for 224×224 images (ImageNet stem)."""
    return ResNet(Bottleneck, (3, 4, 6, 3), small_input=False, in_channels=in_channels)


def make_backbone(arch: str, in_channels: int = 3) -> nn.Module:
    if arch == "small":
        return SmallCNN(in_channels)
    if arch == "resnet18":
        return resnet18(in_channels)
    if arch == "resnet50":
        return resnet50(in_channels)
    raise ValueError(f"unknown backbone {arch!r}; choose one of {', '.join(ARCHS)}")


class VisionOrcaNet(nn.Module):
    """Backbone + ORCA's normalised head (:class:`orca_sc.module.NormedLinear`, scale ``s`` as
    in the single-cell model). ``forward`` returns ``(logits (B, K), features (B, D))``.
    """

    def __init__(self, arch: str, n_heads: int, in_channels: int = 3) -> None:
        super().__init__()
        self.arch = arch
        self.backbone = make_backbone(arch, in_channels)
        self.head = NormedLinear(self.backbone.out_dim, n_heads)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = self.backbone(x)
        return self.head(z), z


def freeze_all_but_last_block(net: VisionOrcaNet) -> list[nn.Parameter]:
    """Freeze the backbone except its last block; returns the parameters left to train (the
    last block and the head).
    """
    keep = {id(p) for p in net.backbone.last_block.parameters()}
    keep |= {id(p) for p in net.head.parameters()}
    for p in net.parameters():
        p.requires_grad_(id(p) in keep)
    return [p for p in net.parameters() if p.requires_grad]


def n_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
