"""One-time conversion of a GGUF file into a Hugging Face model directory.

Dequantizing GGUF through transformers is slow, so it is done once and the
result kept in a cache directory; later runs load plain float32 safetensors.

A cache entry is named ``<gguf stem>-<hash>``, the hash covering the GGUF file's
content and the conversion format version: an edited or replaced file gets a
fresh entry, and copies of one file share one (every virtualenv installs the
default model's file anew, with a new path and mtime). Reading the file to hash
it takes ~0.1 s for the default model's 94 MiB, so the result is remembered in
``index/`` under the file's path, size and mtime: a file seen before costs a
``stat`` and one small read.

Invariant: an entry directory exists only once it is complete. It is written
into a temporary sibling and renamed into place, which is atomic on one file
system, so a crash leaves at most a temporary directory (removed by the next
conversion) and never a half entry. A file lock per entry makes concurrent
processes wait for one conversion instead of each doing it; if the lock is not
honoured (some network file systems), losing the rename race is still safe.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from filelock import FileLock

logger = logging.getLogger(__name__)

CACHE_ENV = "ASYNCBATCH_CACHE"
CACHE_FORMAT_VERSION = 1
_TEMP_MARK = ".tmp-"


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """``cache_dir`` if given, else ``$ASYNCBATCH_CACHE``, else ``~/.cache/asyncbatch``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "asyncbatch"


def cache_entry_name(gguf_path: Path, root: Path | None = None) -> str:
    """``<stem>-<12 hex digits>`` identifying this file's content (``root``: the cache whose index remembers the
    digest of a file seen before; None reads the file every time)."""
    path = gguf_path.resolve()
    st = path.stat()
    seen = f"{path}\0{st.st_size}\0{st.st_mtime_ns}"
    index = root / "index" / hashlib.sha256(seen.encode()).hexdigest()[:24] if root is not None else None
    digest = None
    if index is not None and index.is_file():
        digest = index.read_text().strip() or None
    if digest is None:
        digest = _file_digest(path)
        if index is not None:
            index.parent.mkdir(parents=True, exist_ok=True)
            # A temporary file of this writer's own (threads of one process too), renamed into place: atomic, so
            # a concurrent reader sees the whole digest or no file, and concurrent writers write the same digest.
            fd, temp = tempfile.mkstemp(prefix=f"{index.name}{_TEMP_MARK}", dir=index.parent)
            with os.fdopen(fd, "w") as f:
                f.write(digest)
            os.replace(temp, index)
    key = f"{CACHE_FORMAT_VERSION}\0{digest}"
    return f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def _file_digest(path: Path) -> str:
    digest = hashlib.blake2b()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def is_complete_entry(directory: Path) -> bool:
    return (directory / "config.json").is_file()


def convert_gguf(gguf_path: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Return the Hugging Face directory for ``gguf_path``, converting it on first use."""
    gguf_path = Path(gguf_path)
    root = cache_root(cache_dir)
    name = cache_entry_name(gguf_path, root)  # makes root/index for a file it has not seen
    entry = root / name
    if is_complete_entry(entry):
        return entry
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / f"{name}.lock")):
        if is_complete_entry(entry):  # another process converted it while we waited
            return entry
        _remove_stale_temps(root, name)
        if entry.exists():  # incomplete, so not another writer's (they rename complete trees): a damaged entry
            shutil.rmtree(entry)
        temp = Path(tempfile.mkdtemp(prefix=f".{name}{_TEMP_MARK}", dir=root))
        try:
            logger.warning("converting %s once into %s (this takes a while)", gguf_path, entry)
            write_hf_directory(gguf_path, temp)
            _fsync_tree(temp)
            try:
                os.rename(temp, entry)
            except OSError:
                if not is_complete_entry(entry):
                    raise
                # Lost a race with a process that ignored the lock: its entry is complete too.
        finally:
            shutil.rmtree(temp, ignore_errors=True)
    return entry


def write_hf_directory(gguf_path: Path, out: Path) -> None:
    """Dequantize ``gguf_path`` to float32 and write config, weights, tokenizer into ``out``.

    ``save_pretrained`` refuses a model that transformers marks as GGUF
    quantized, so the state dict and config are written by hand.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, file_name = str(gguf_path.resolve().parent), gguf_path.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file_name, dtype=torch.float32)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]  # GGUF metadata carries none
    config["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    state = model.state_dict()
    if config.get("tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # shares storage with the embedding; safetensors refuses aliases
    state = {key: tensor.contiguous() for key, tensor in state.items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    model.generation_config.save_pretrained(out)
    AutoTokenizer.from_pretrained(folder, gguf_file=file_name).save_pretrained(out)


def _remove_stale_temps(root: Path, name: str) -> None:
    """Temporaries left by crashed conversions; safe because we hold the entry's lock."""
    for stale in root.glob(glob.escape(f".{name}{_TEMP_MARK}") + "*"):
        shutil.rmtree(stale, ignore_errors=True)


def _fsync_tree(directory: Path) -> None:
    """Flush file contents before the rename publishes them, so a power loss cannot expose empty files."""
    for path in directory.iterdir():
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
