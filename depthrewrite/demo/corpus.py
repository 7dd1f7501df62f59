"""A byte-level text corpus that every Python installation already has: the standard library's own source files.

Used by ``depthrewrite demo`` and ``python -m bench.quality``::

    corpus = Corpus.stdlib()                  # the running interpreter's Lib/*.py, read as bytes
    corpus = Corpus.from_dir("my/code")       # or any folder of text files
    x, y = corpus.batch("train", 16, 128, generator)       # [16, 128] int64 byte ids and their next bytes
    for x, y in corpus.eval_batches(8, 16, 128): ...        # fixed validation windows from held-out files

The split is by file and deterministic: a file is held out for validation when the CRC-32 of its path relative to the
corpus root falls in the validation fraction, so the same interpreter always gives the same split, and no validation
byte comes from a file seen in training.
"""

from __future__ import annotations

import sysconfig
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import ConfigError

__all__ = ["Corpus", "stdlib_root", "split_of"]

VOCAB = 256  # byte-level
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_root() -> Path:
    """The folder of the running interpreter's standard library (``sysconfig``'s ``stdlib`` path)."""
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(relative_path: str, val_fraction: float) -> str:
    """``"val"`` or ``"train"`` for a file, from the CRC-32 of its relative POSIX path (stable across runs and OSes)."""
    bucket = zlib.crc32(relative_path.encode("utf-8")) % 10_000
    return "val" if bucket < val_fraction * 10_000 else "train"


@dataclass
class Corpus:
    """Train and validation bytes, each the concatenation of its files (in sorted path order)."""

    root: Path
    train: torch.Tensor  # uint8 [N_train]
    val: torch.Tensor  # uint8 [N_val]
    train_files: int
    val_files: int
    name: str = "corpus"
    _cache: dict = field(default_factory=dict, repr=False)

    @classmethod
    def stdlib(cls, val_fraction: float = 0.1, max_bytes: int | None = None) -> "Corpus":
        """The standard library's ``*.py`` files (third-party ``site-packages`` excluded)."""
        root = stdlib_root()
        corpus = cls.from_dir(root, pattern="*.py", val_fraction=val_fraction, max_bytes=max_bytes)
        corpus.name = f"Python {'.'.join(map(str, __import__('sys').version_info[:2]))} standard library"
        return corpus

    @classmethod
    def from_dir(
        cls, root: str | Path, pattern: str = "*.py", val_fraction: float = 0.1, max_bytes: int | None = None
    ) -> "Corpus":
        """Every file matching ``pattern`` under ``root``, split by file.

        ``max_bytes`` caps each split's size (files are taken in sorted order until the cap; the split stays by file).
        """
        root = Path(root)
        if not root.is_dir():
            raise ConfigError(f"corpus folder {str(root)!r} does not exist")
        if not 0.0 < val_fraction < 1.0:
            raise ConfigError(f"val_fraction must be in (0, 1), got {val_fraction}")
        files = sorted(
            (p for p in root.rglob(pattern) if p.is_file() and not _SKIP_DIRS.intersection(p.relative_to(root).parts)),
            key=lambda p: p.relative_to(root).as_posix(),
        )
        parts: dict[str, list[bytes]] = {"train": [], "val": []}
        sizes = {"train": 0, "val": 0}
        for p in files:
            split = split_of(p.relative_to(root).as_posix(), val_fraction)
            if max_bytes is not None and sizes[split] >= max_bytes:
                continue
            try:
                data = p.read_bytes()
            except OSError:
                continue
            if data:
                parts[split].append(data)
                sizes[split] += len(data)
        if not parts["train"] or not parts["val"]:
            raise ConfigError(
                f"no {pattern} files to train and validate on under {root} (found {len(files)}); "
                "point the corpus at a folder of text files"
            )
        # files are joined with a NUL byte, which never occurs in source text: a visible document boundary
        tensors = {k: torch.frombuffer(bytearray(b"\0".join(v)), dtype=torch.uint8) for k, v in parts.items()}
        return cls(
            root=root,
            train=tensors["train"],
            val=tensors["val"],
            train_files=len(parts["train"]),
            val_files=len(parts["val"]),
            name=str(root),
        )

    def __str__(self) -> str:
        return (
            f"{self.name}: {self.train_files} train files ({len(self.train) / 1e6:.1f} MB), "
            f"{self.val_files} validation files ({len(self.val) / 1e6:.1f} MB), byte-level (vocab {VOCAB})"
        )

    def _data(self, split: str) -> torch.Tensor:
        if split not in ("train", "val"):
            raise ConfigError(f"split must be 'train' or 'val', got {split!r}")
        data = getattr(self, split)
        return data

    def batch(
        self, split: str, batch: int, seq: int, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``batch`` random windows of ``seq + 1`` bytes: inputs ``x [batch, seq]`` and next-byte targets ``y``."""
        data = self._data(split)
        if len(data) < seq + 1:
            raise ConfigError(f"the {split} split has {len(data)} bytes, fewer than a window of {seq + 1}")
        # a window starts at 0 .. len - (seq + 1), both included (randint's high is exclusive)
        starts = torch.randint(0, len(data) - seq, (batch,), generator=generator)
        idx = starts[:, None] + torch.arange(seq + 1)
        win = data[idx].long()
        return win[:, :-1], win[:, 1:]

    def eval_batches(self, n: int, batch: int, seq: int, seed: int = 1234) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``n`` fixed validation batches (the same windows for every model and seed)."""
        key = (n, batch, seq, seed)
        if key not in self._cache:
            g = torch.Generator().manual_seed(seed)
            self._cache[key] = [self.batch("val", batch, seq, g) for _ in range(n)]
        return self._cache[key]
