"""Image augmentations in plain torch, batched on the device (no per-image Python loop).

Every function takes float images ``(B, C, H, W)`` in ``[0, 1]`` (or uint8, converted) and a
``torch.Generator`` on the images' device, and draws one independent transform per image.

* ORCA training (paper App. A, from He et al. 2016): :func:`random_crop` with 4-px zero padding +
  :func:`random_flip` (CIFAR); :func:`random_resized_crop` + flip (ImageNet).
* SimCLR pretraining (Chen et al. 2020): random resized crop (scale 0.08–1, aspect 3/4–4/3) + flip,
  colour jitter (brightness/contrast/saturation 0.4, hue 0.1) with p = 0.8, grayscale with p = 0.2.
  The four jitters are applied in a fixed order (torchvision draws a random order per image).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

_GRAY = (0.299, 0.587, 0.114)


def _rand(n: int, gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.rand((n, *shape), generator=gen, device=gen.device)


def to_float(x: torch.Tensor) -> torch.Tensor:
    """uint8 ``[0, 255]`` -> float32 ``[0, 1]`` (float input is returned as float32)."""
    return x.float().div_(255.0) if x.dtype == torch.uint8 else x.float()


def random_crop(x: torch.Tensor, padding: int, gen: torch.Generator) -> torch.Tensor:
    """Pad by ``padding`` zeros on each side and take a random crop of the original size."""
    if padding <= 0:
        return x
    b, c, h, w = x.shape
    padded = F.pad(x, (padding, padding, padding, padding))
    oy = (_rand(b, gen) * (2 * padding + 1)).long().clamp_max(2 * padding)
    ox = (_rand(b, gen) * (2 * padding + 1)).long().clamp_max(2 * padding)
    rows = oy[:, None] + torch.arange(h, device=x.device)  # (B, H)
    cols = ox[:, None] + torch.arange(w, device=x.device)  # (B, W)
    bi = torch.arange(b, device=x.device)[:, None, None, None]
    ci = torch.arange(c, device=x.device)[None, :, None, None]
    return padded[bi, ci, rows[:, None, :, None], cols[:, None, None, :]]


def random_flip(x: torch.Tensor, gen: torch.Generator, p: float = 0.5) -> torch.Tensor:
    """Flip each image left-right with probability ``p``."""
    flip = _rand(x.shape[0], gen) < p
    return torch.where(flip[:, None, None, None], x.flip(-1), x)


def random_resized_crop(
    x: torch.Tensor,
    size: int,
    gen: torch.Generator,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
) -> torch.Tensor:
    """A crop of random area (``scale`` of the image) and aspect ratio, resized bilinearly to
    ``size``×``size`` (one ``affine_grid``/``grid_sample`` for the batch). Sides that would
    exceed the image are clipped to it (torchvision retries 10 times, then falls back to a
    centre crop).
    """
    b = x.shape[0]
    area = scale[0] + (scale[1] - scale[0]) * _rand(b, gen)
    log_r = math.log(ratio[0]) + (math.log(ratio[1]) - math.log(ratio[0])) * _rand(b, gen)
    r = torch.exp(log_r)
    w = torch.sqrt(area * r).clamp(max=1.0)  # fraction of the width
    h = torch.sqrt(area / r).clamp(max=1.0)
    cx = w / 2 + (1 - w) * _rand(b, gen)  # centre, in [w/2, 1 - w/2]
    cy = h / 2 + (1 - h) * _rand(b, gen)
    theta = torch.zeros(b, 2, 3, device=x.device)
    theta[:, 0, 0] = w
    theta[:, 0, 2] = 2 * cx - 1
    theta[:, 1, 1] = h
    theta[:, 1, 2] = 2 * cy - 1
    grid = F.affine_grid(theta, [b, x.shape[1], size, size], align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)


def center_crop_resize(x: torch.Tensor, size: int, crop_fraction: float = 0.875) -> torch.Tensor:
    """Deterministic test view: the central ``crop_fraction`` of the image resized to ``size``
    (ImageNet's resize-256/centre-crop-224 when ``crop_fraction = 224/256``).
    """
    h, w = x.shape[-2:]
    ch, cw = round(h * crop_fraction), round(w * crop_fraction)
    top, left = (h - ch) // 2, (w - cw) // 2
    x = x[..., top : top + ch, left : left + cw]
    if (ch, cw) == (size, size):
        return x
    return F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False, antialias=True)


def grayscale(x: torch.Tensor) -> torch.Tensor:
    """Luma (ITU-R 601) of RGB images, kept as 3 channels."""
    g = sum(wt * x[:, i] for i, wt in enumerate(_GRAY))[:, None]
    return g.expand_as(x)


def _rgb_to_hsv(x: torch.Tensor) -> torch.Tensor:
    r, g, b = x.unbind(1)
    maxc, _ = x.max(dim=1)
    minc, _ = x.min(dim=1)
    delta = maxc - minc
    s = torch.where(maxc > 0, delta / maxc.clamp_min(1e-12), torch.zeros_like(maxc))
    d = delta.clamp_min(1e-12)
    rc, gc, bc = (maxc - r) / d, (maxc - g) / d, (maxc - b) / d
    h = torch.where(maxc == r, bc - gc, torch.where(maxc == g, 2.0 + rc - bc, 4.0 + gc - rc))
    h = torch.where(delta > 0, (h / 6.0) % 1.0, torch.zeros_like(h))
    return torch.stack([h, s, maxc], dim=1)


def _hsv_to_rgb(x: torch.Tensor) -> torch.Tensor:
    h, s, v = x.unbind(1)
    i = torch.floor(h * 6.0)
    f = h * 6.0 - i
    i = i.long() % 6
    p, q, t = v * (1 - s), v * (1 - s * f), v * (1 - s * (1 - f))
    # rows: the (r, g, b) sources for sector i = 0..5
    table = torch.stack(
        [
            torch.stack([v, t, p], 1),
            torch.stack([q, v, p], 1),
            torch.stack([p, v, t], 1),
            torch.stack([p, q, v], 1),
            torch.stack([t, p, v], 1),
            torch.stack([v, p, q], 1),
        ],
        dim=1,
    )  # (B, 6, 3, H, W)
    idx = i[:, None, None].expand(-1, 1, 3, -1, -1)
    return table.gather(1, idx).squeeze(1)


def color_jitter(
    x: torch.Tensor,
    gen: torch.Generator,
    brightness: float = 0.4,
    contrast: float = 0.4,
    saturation: float = 0.4,
    hue: float = 0.1,
    p: float = 0.8,
) -> torch.Tensor:
    """With probability ``p`` per image: brightness, contrast, saturation factors drawn from
    ``[1 - a, 1 + a]`` and a hue shift from ``[-hue, hue]`` (saturation and hue need 3 channels).
    """
    b = x.shape[0]
    apply = (_rand(b, gen) < p)[:, None, None, None]

    def factor(a: float) -> torch.Tensor:
        return (1 - a + 2 * a * _rand(b, gen))[:, None, None, None]

    out = (x * factor(brightness)).clamp(0, 1)
    gray = grayscale(out) if x.shape[1] == 3 else out
    mean = gray.mean(dim=(1, 2, 3), keepdim=True)
    out = ((out - mean) * factor(contrast) + mean).clamp(0, 1)
    if x.shape[1] == 3:
        gray = grayscale(out)
        out = ((out - gray) * factor(saturation) + gray).clamp(0, 1)
        shift = (2 * _rand(b, gen) - 1) * hue
        hsv = _rgb_to_hsv(out)
        hsv = torch.cat([(hsv[:, :1] + shift[:, None, None, None]) % 1.0, hsv[:, 1:]], dim=1)
        out = _hsv_to_rgb(hsv).clamp(0, 1)
    return torch.where(apply, out, x)


def random_grayscale(x: torch.Tensor, gen: torch.Generator, p: float = 0.2) -> torch.Tensor:
    """Convert each RGB image to grayscale with probability ``p`` (single-channel: unchanged)."""
    if x.shape[1] != 3:
        return x
    pick = (_rand(x.shape[0], gen) < p)[:, None, None, None]
    return torch.where(pick, grayscale(x), x)


@dataclass(frozen=True)
class AugmentSpec:
    """How one dataset's images are augmented and normalised.

    ``size``: network input side; ``padding``: random-crop padding of ORCA's views (0: use a
    random resized crop with ``train_scale`` instead, as for ImageNet); ``flip``: horizontal flips;
    ``test_crop``: fraction of the stored image kept for the test view; ``simclr_scale``: area
    range of SimCLR's crops; ``mean``/``std``: per-channel normalisation.
    """

    size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    padding: int = 4
    flip: bool = True
    train_scale: tuple[float, float] = (0.08, 1.0)
    test_crop: float = 1.0
    simclr_scale: tuple[float, float] = (0.08, 1.0)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        mean = torch.tensor(self.mean, device=x.device)[None, :, None, None]
        std = torch.tensor(self.std, device=x.device)[None, :, None, None]
        return (x - mean) / std

    def test_view(self, x: torch.Tensor) -> torch.Tensor:
        x = to_float(x)
        if self.test_crop < 1.0 or x.shape[-1] != self.size:
            x = center_crop_resize(x, self.size, self.test_crop)
        return self.normalize(x)

    def orca_view(self, x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """ORCA's training view: random crop with padding (or random resized crop) + flip."""
        x = to_float(x)
        if self.padding > 0 and x.shape[-1] == self.size:
            x = random_crop(x, self.padding, gen)
        else:
            x = random_resized_crop(x, self.size, gen, self.train_scale)
        if self.flip:
            x = random_flip(x, gen)
        return self.normalize(x)

    def simclr_view(self, x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """SimCLR's view: random resized crop, flip, colour jitter, grayscale."""
        x = random_resized_crop(to_float(x), self.size, gen, self.simclr_scale)
        if self.flip:
            x = random_flip(x, gen)
        x = color_jitter(x, gen)
        x = random_grayscale(x, gen)
        return self.normalize(x)
