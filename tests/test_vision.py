"""orca_sc.vision: backbones, augmentations, NT-Xent, splits, checkpoints, the archive downloader
(local HTTP server) and a tiny end-to-end run on scikit-learn's real 8×8 digits.
"""

import colorsys
import hashlib
import io
import json
import math
import pickle
import subprocess
import sys
import tarfile

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from conftest import _Handler, assert_cli_error

import orca_sc
from orca_sc import losses, module, vision
from orca_sc._errors import ConfigError, OrcaInputError
from orca_sc.cli import main
from orca_sc.datasets import DownloadError, Manifest
from orca_sc.vision import _augment as A
from orca_sc.vision import _data as D
from orca_sc.vision._nets import n_parameters


# ------------------------------------------------------------------------------------ backbones
def test_backbone_shapes_and_parameter_counts():
    r18 = vision.resnet18()
    assert n_parameters(r18) == 11_168_832  # torchvision's 11,173,962 less the 10-class fc
    assert r18(torch.zeros(2, 3, 32, 32)).shape == (2, 512)
    r50 = vision.resnet50()
    assert n_parameters(r50) == 23_508_032  # torchvision's 25,557,032 less the 1000-class fc
    assert r50(torch.zeros(1, 3, 64, 64)).shape == (1, 2048)
    assert vision.SmallCNN(1)(torch.zeros(3, 1, 8, 8)).shape == (3, 128)
    net = vision.VisionOrcaNet("resnet18", n_heads=10)
    logits, feats = net(torch.zeros(2, 3, 32, 32))
    assert logits.shape == (2, 10) and feats.shape == (2, 512)
    # one head for cells and images: ORCA's normalised head with the core's scale s
    assert isinstance(net.head, module.NormedLinear) and net.head.scale == 10.0
    assert logits.abs().max() <= 10.0 + 1e-5
    keep = vision.freeze_all_but_last_block(net)
    trainable = {n for n, p in net.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith(("backbone.layer4.", "head.")) for n in trainable)
    assert sum(p.numel() for p in keep) == n_parameters(net.backbone.layer4) + 512 * 10


def test_the_vision_trainer_uses_the_core_objective():
    from orca_sc.vision import _train

    assert _train.orca_objective is losses.orca_objective
    assert _train.adaptive_margin is losses.adaptive_margin


def test_import_orca_sc_does_not_import_vision():
    code = "import sys, orca_sc, orca_sc.cli; print('orca_sc.vision' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# -------------------------------------------------------------------------------- augmentations
def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_augmentations_keep_shape_and_dtype_and_differ_per_image():
    spec = vision.AugmentSpec(size=32, mean=(0.5,) * 3, std=(0.25,) * 3)
    img = torch.randint(0, 256, (1, 3, 32, 32), dtype=torch.uint8)
    batch = img.expand(16, -1, -1, -1).contiguous()  # 16 copies of one image
    for view in (spec.orca_view, spec.simclr_view):
        out = view(batch, _gen())
        assert out.shape == (16, 3, 32, 32) and out.dtype == torch.float32
        distinct = {hashlib.md5(o.numpy().tobytes()).hexdigest() for o in out}
        assert len(distinct) >= 12  # an independent draw per image
        assert torch.equal(out, view(batch, _gen()))  # same generator state, same views
    x = A.to_float(batch)
    for f in (A.color_jitter, A.random_grayscale, A.random_flip):
        y = f(x, _gen())
        assert y.shape == x.shape and y.dtype == x.dtype and 0 <= y.min() and y.max() <= 1
    assert A.random_resized_crop(x, 24, _gen()).shape == (16, 3, 24, 24)
    assert A.random_crop(x, 4, _gen()).shape == x.shape


def test_augmentations_are_the_transforms_they_claim():
    x = torch.rand(6, 3, 10, 12)
    crop = A.random_crop(x, 2, _gen(1))
    padded = torch.nn.functional.pad(x, (2, 2, 2, 2))
    for i in range(6):  # each crop is a window of its padded image
        hits = [
            (dy, dx)
            for dy in range(5)
            for dx in range(5)
            if torch.equal(crop[i], padded[i, :, dy : dy + 10, dx : dx + 12])
        ]
        assert hits
    flipped = A.random_flip(x, _gen(2), p=1.0)
    assert torch.equal(flipped, x.flip(-1))
    assert torch.equal(A.random_flip(x, _gen(2), p=0.0), x)
    # the whole image at scale 1 and aspect 1 is the identity (bilinear, aligned grid)
    whole = A.random_resized_crop(x[:, :, :10, :10], 10, _gen(), scale=(1, 1), ratio=(1, 1))
    assert torch.allclose(whole, x[:, :, :10, :10], atol=1e-5)
    gray = A.random_grayscale(x, _gen(), p=1.0)
    assert torch.equal(gray[:, 0], gray[:, 1]) and torch.equal(gray[:, 1], gray[:, 2])
    hsv = A._rgb_to_hsv(x)
    for i, j, k in [(0, 0, 0), (3, 4, 5), (5, 9, 11)]:
        want = colorsys.rgb_to_hsv(*x[i, :, j, k].tolist())
        assert np.allclose(hsv[i, :, j, k].numpy(), want, atol=1e-5)
    assert torch.allclose(A._hsv_to_rgb(hsv), x, atol=1e-5)
    # a hue shift of zero and unit factors leave the image as it was
    same = A.color_jitter(x, _gen(), brightness=0, contrast=0, saturation=0, hue=0, p=1.0)
    assert torch.allclose(same, x, atol=1e-5)


# ------------------------------------------------------------------------------------- NT-Xent
def test_nt_xent_matches_a_hand_computed_value():
    z1 = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    z2 = torch.tensor([[1.0, 1.0], [-1.0, 0.0]])
    t = 0.5
    zs = [v / np.linalg.norm(v) for v in np.concatenate([z1.numpy(), z2.numpy()])]
    n = 2
    losses = []
    for i in range(2 * n):
        pos = (i + n) % (2 * n)
        num = math.exp(zs[i] @ zs[pos] / t)
        den = sum(math.exp(zs[i] @ zs[k] / t) for k in range(2 * n) if k != i)
        losses.append(-math.log(num / den))
    assert vision.nt_xent(z1, z2, t).item() == pytest.approx(np.mean(losses), rel=1e-6)


# -------------------------------------------------------------------------------------- splits
def test_open_world_split_sizes_and_disjointness():
    y = np.repeat(np.arange(10), 50)
    np.random.default_rng(0).shuffle(y)
    s = vision.open_world_split(y, 10, seed=0)
    assert s.n_seen == 5
    assert np.intersect1d(s.labelled, s.unlabelled).size == 0
    assert np.array_equal(np.sort(np.concatenate([s.labelled, s.unlabelled])), np.arange(500))
    assert set(y[s.labelled]) == set(range(5))
    assert all((y[s.labelled] == c).sum() == 25 for c in range(5))  # 50% of each seen class
    assert (y[s.unlabelled] >= 5).sum() == 250  # every novel-class image is unlabelled
    t = s.targets(y)
    assert np.array_equal(t[s.labelled], y[s.labelled]) and (t[s.unlabelled] == -1).all()
    other = vision.open_world_split(y, 10, seed=1)
    assert not np.array_equal(other.labelled, s.labelled)
    ten = vision.open_world_split(y, 10, labelled_fraction=0.1, seen_fraction=0.2, seed=0)
    assert ten.n_seen == 2 and ten.labelled.size == 10
    with pytest.raises(ConfigError, match="seen_fraction"):
        vision.open_world_split(y, 10, seen_fraction=1.0)


# --------------------------------------------------------------------------------- data loaders
def test_npz_loader_layouts_and_errors(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (20, 12, 12, 3), dtype=np.uint8)
    y = np.arange(20) % 4
    p = tmp_path / "d.npz"
    np.savez(p, x_train=x, y_train=y, x_test=x[:8], y_test=y[:8], classes=np.array(list("abcd")))
    d = vision.load_images(f"npz:{p}")
    assert d.train.shape == (3, 12, 12) and len(d.train) == 20 and d.classes == tuple("abcd")
    assert torch.equal(d.train.x[3], torch.from_numpy(x[3]).permute(2, 0, 1))
    np.savez(p, x_train=x[..., 0], y_train=y, x_test=x[:8, ..., 0], y_test=y[:8])
    assert vision.load_images(f"npz:{p}").in_channels == 1
    np.savez(p, x_train=x.astype(np.float32), y_train=y, x_test=x[:8], y_test=y[:8])
    with pytest.raises(OrcaInputError, match="must be uint8"):
        vision.load_images(f"npz:{p}")
    np.savez(p, x_train=x, y_train=y)
    with pytest.raises(OrcaInputError, match="lacks the arrays x_test, y_test"):
        vision.load_images(f"npz:{p}")
    with pytest.raises(OrcaInputError, match="Unknown dataset 'mnist'"):
        vision.load_images("mnist")
    with pytest.raises(OrcaInputError, match="data_dir"):
        vision.load_images("imagenet100")


def _cifar_archive(kind: str) -> tuple[bytes, np.ndarray]:
    """A small archive laid out as the official CIFAR python release."""
    rng = np.random.default_rng(1)
    buf = io.BytesIO()
    n_cls = 10 if kind == "cifar10" else 100
    images = rng.integers(0, 256, (60, 3072), dtype=np.uint8)
    labels = [int(i) % n_cls for i in range(60)]

    def add(tar, name, obj):
        data = pickle.dumps(obj)
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))

    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        if kind == "cifar10":
            for i in range(5):
                part = slice(10 * i, 10 * i + 10)
                add(tar, f"cifar-10-batches-py/data_batch_{i + 1}",
                    {"data": images[part], "labels": labels[part]})  # fmt: skip
            add(tar, "cifar-10-batches-py/test_batch", {"data": images[50:], "labels": labels[50:]})
            add(
                tar,
                "cifar-10-batches-py/batches.meta",
                {"label_names": [f"c{i}" for i in range(10)]},
            )
        else:
            add(tar, "cifar-100-python/train", {"data": images[:50], "fine_labels": labels[:50]})
            add(tar, "cifar-100-python/test", {"data": images[50:], "fine_labels": labels[50:]})
            add(tar, "cifar-100-python/meta", {"fine_label_names": [f"f{i}" for i in range(100)]})
    return buf.getvalue(), images


@pytest.mark.parametrize("kind", ["cifar10", "cifar100"])
def test_cifar_archives_download_verify_and_load(server, tmp_path, monkeypatch, kind):
    payload, images = _cifar_archive(kind)
    shipped = orca_sc.datasets.manifests()[kind]
    fname = shipped.files[0].filename
    assert shipped.files[0].url.startswith("https://www.cs.toronto.edu/~kriz/")
    assert shipped.files[0].md5 and shipped.files[0].size > 100_000_000
    _, url = server
    raw = dict(shipped.raw)
    raw["files"] = [{"filename": fname, "url": f"{url}/{fname}", "size": len(payload),
                     "md5": hashlib.md5(payload).hexdigest()}]  # fmt: skip
    monkeypatch.setattr(D, "get_manifest", lambda name: Manifest.from_dict(raw))
    _Handler.files[f"/{fname}"] = payload
    d = vision.load_images(kind, cache_dir=tmp_path)
    assert (
        len(d.train) == 50
        and len(d.test) == 10
        and d.n_classes == (10 if kind == "cifar10" else 100)
    )
    assert torch.equal(d.train.x[7].reshape(-1), torch.from_numpy(images[7]))
    assert d.train.shape == (3, 32, 32) and d.augment.padding == 4
    # cached: no second request
    n = len(_Handler.requests)
    vision.load_images(kind, cache_dir=tmp_path)
    assert len(_Handler.requests) == n
    # a corrupted download is refused and not kept
    bad = tmp_path / "bad"
    _Handler.files[f"/{fname}"] = payload[:-1] + bytes([payload[-1] ^ 1])
    with pytest.raises(DownloadError, match="(?i)md5|checksum"):
        vision.load_images(kind, cache_dir=bad)
    assert not (bad / kind / fname).exists()


def test_imagenet100_folder_tree(tmp_path):
    from PIL import Image

    wnids = vision.imagenet100_classes()
    assert len(wnids) == 100 and wnids[0] == "n01558993" and wnids[-1] == "n11879895"
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for w in wnids:
            (tmp_path / split / w).mkdir(parents=True)
            arr = rng.integers(0, 256, (20, 30, 3), dtype=np.uint8)
            Image.fromarray(arr).save(tmp_path / split / w / "a.JPEG", format="PNG")
    d = vision.load_images("imagenet100", data_dir=tmp_path)
    assert len(d.train) == 100 and len(d.test) == 100 and d.classes[5] == wnids[5]
    (x,) = list(d.train.batches([np.array([0, 99, 50])], torch.device("cpu")))
    assert x.shape == (3, 3, 256, 256) and x.dtype == torch.uint8
    assert d.augment.orca_view(x, _gen()).shape == (3, 3, 224, 224)
    assert d.augment.test_view(x).shape == (3, 3, 224, 224)
    (tmp_path / "val" / wnids[3] / "a.JPEG").unlink()
    with pytest.raises(OrcaInputError, match=f"first: {wnids[3]}"):
        vision.load_images("imagenet100", data_dir=tmp_path)


# ------------------------------------------------------------------------------------ training
@pytest.fixture(scope="module")
def digits():
    with pytest.raises(OrcaInputError, match=r"image dataset.*vision.load_images\('digits'\)"):
        orca_sc.datasets.load("digits")  # the download layer knows nothing of vision
    d = vision.load_images("digits")
    assert isinstance(d, vision.ImageData)
    return d


@pytest.fixture(scope="module")
def simclr_digits(digits, tmp_path_factory):
    path = tmp_path_factory.mktemp("simclr") / "digits_simclr.pt"
    cfg = vision.PretrainConfig(arch="small", epochs=10, batch_size=256, seed=0)
    run = vision.pretrain_simclr(digits, cfg, progress=False, checkpoint=path)
    return path, run


def test_tiny_end_to_end_on_real_digits(digits, simclr_digits):
    """SimCLR then ORCA on scikit-learn's 8×8 digits (5 seen, 5 novel classes). Chance for the
    novel Hungarian accuracy is about 0.2 (5 balanced classes): require 0.25 above it. As the
    Hungarian accuracy alone also scores a novel class absorbed by a seen one, also require that
    novel heads take a real share of the novel-class images and almost none of the seen ones.
    Measured over 2 pretrainings × 3 seeds × 1-2 threads: novel 0.70-0.81, novel→novel
    0.35-0.87, seen ≥ 0.97, seen→novel ≤ 0.014, 2-5 novel heads found.
    """
    path, pre = simclr_digits
    assert pre.history[-1]["loss"] < pre.history[0]["loss"] - 0.5
    assert digits.n_classes == 10 and len(digits.train) == 1438 and digits.train.shape == (1, 8, 8)
    cfg = vision.preset("digits", eval_test=False, seed=0)
    run = vision.train_orca(digits, cfg, pretrained=path, progress=False)
    last = run.history[-1]
    assert len(run.history) == 30 and run.history[0]["margin"] > last["margin"]
    assert last["u_novel"] > 0.2 + 0.25, last
    assert last["u_novel_called_novel"] > 0.25, last
    assert last["u_seen"] > 0.9 and last["u_seen_called_novel"] < 0.05, last
    assert last["u_novel_found"] >= 2 and last["t_seen"] > 0.9  # test split scored at the end
    assert run.head_names()[:5] == ["0", "1", "2", "3", "4"] and run.head_names()[5] == "novel_1"
    km = vision.kmeans_baseline(pre.backbone, digits, run.split, seed=0)
    assert km["u_novel"] > 0.45 and 0 <= km["t_all"] <= 1


def test_checkpoint_round_trip_and_exact_resume(digits, simclr_digits, tmp_path):
    path, _ = simclr_digits
    cfg = vision.preset("digits", epochs=3, milestones=(2,), seed=3)
    full = vision.train_orca(
        digits, cfg, pretrained=path, progress=False, checkpoint=tmp_path / "a.pt"
    )
    net, meta = vision.load_orca(tmp_path / "a.pt")
    assert meta["epoch"] == 3 and meta["n_seen"] == 5 and meta["kind"] == "orca"
    assert json.loads((tmp_path / "a.pt.json").read_text())["head_names"][5] == "novel_1"
    for k, v in full.net.state_dict().items():
        assert torch.equal(v, net.state_dict()[k]), k
    dev = torch.device("cpu")
    h1, _, _ = vision.predict(full.net, digits.test, digits.augment, dev)
    h2, _, _ = vision.predict(net, digits.test, digits.augment, dev)
    assert np.array_equal(h1, h2)
    # interrupted after 2 epochs, resumed: the same weights and history as the straight run
    two = vision.preset("digits", epochs=2, milestones=(2,), seed=3)
    vision.train_orca(digits, two, pretrained=path, progress=False, checkpoint=tmp_path / "b.pt")
    resumed = vision.train_orca(
        digits, cfg, pretrained=path, progress=False, checkpoint=tmp_path / "b.pt",
        resume=tmp_path / "b.pt",
    )  # fmt: skip
    for k, v in full.net.state_dict().items():
        assert torch.equal(v, resumed.net.state_dict()[k]), k
    keys = ("loss", "u_seen", "u_novel", "margin", "lr")
    assert [[h[k] for k in keys] for h in resumed.history] == [
        [h[k] for k in keys] for h in full.history
    ]
    # wrong kind, damaged tensors, missing metadata
    with pytest.raises(OrcaInputError, match="SimCLR pretraining checkpoint is needed"):
        vision.train_orca(digits, cfg, pretrained=tmp_path / "a.pt", progress=False)
    (tmp_path / "c.pt").write_bytes(b"not a torch file")
    (tmp_path / "c.pt.json").write_text((tmp_path / "a.pt.json").read_text())
    with pytest.raises(OrcaInputError, match="damaged"):
        vision.load_orca(tmp_path / "c.pt")
    (tmp_path / "a.pt.json").unlink()
    with pytest.raises(OrcaInputError, match="no metadata"):
        vision.load_orca(tmp_path / "a.pt")


# ------------------------------------------------------------------------------------------ CLI
def test_cli_train_evaluate_and_errors(tmp_path):
    r = CliRunner()
    ck, rep = tmp_path / "o.pt", tmp_path / "o.md"
    res = r.invoke(
        main,
        ["vision", "train", "--dataset", "digits", "--epochs", "2", "-o", str(ck),
         "--report", str(rep), "-q"],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    assert "unlabelled" in res.stdout and ck.exists() and rep.exists()
    assert "Held-out test split" in rep.read_text() and (tmp_path / "o.history.csv").exists()
    res = r.invoke(main, ["vision", "evaluate", str(ck), "--report", str(tmp_path / "e.md")])
    assert res.exit_code == 0, res.output
    assert "test" in res.stdout and (tmp_path / "e.csv").exists()
    before = {p.name for p in tmp_path.iterdir()}
    assert_cli_error(
        r.invoke(main, ["vision", "train", "--dataset", "mnist", "-o", str(tmp_path / "x.pt")]),
        "Unknown dataset 'mnist'",
    )
    assert_cli_error(
        r.invoke(
            main,
            [
                "vision",
                "train",
                "--dataset",
                "digits",
                "--labelled-fraction",
                "0",
                "-o",
                str(tmp_path / "x.pt"),
            ],
        ),  # fmt: skip
        "--labelled-fraction",
    )
    assert_cli_error(
        r.invoke(
            main, ["vision", "train", "--dataset", "digits", "-o", str(tmp_path / "no" / "x.pt")]
        ),
        "does not exist",
    )
    assert_cli_error(
        r.invoke(main, ["vision", "evaluate", str(tmp_path / "missing.pt")]), "does not exist"
    )
    assert_cli_error(  # the checkpoint never overwrites an input
        r.invoke(
            main,
            ["vision", "train", "--dataset", "digits", "--pretrained", str(ck), "-o", str(ck)],
        ),
        "is one of the input files",
    )
    assert {p.name for p in tmp_path.iterdir()} == before  # nothing written by a failed command
