"""The tuner's cache: where ``uniep.tune`` keeps each shape's winner, and what ``moe_forward``
(and ``moe_forward_prepared``, the ``uniep.nn`` modules) run with for an empty tuning string.

A JSON file (``cache_path()``: ``UNIEP_TUNE_CACHE``, else ``$XDG_CACHE_HOME/uniep/tune.json``,
else ``~/.cache/uniep/tune.json``) maps a key (device name, world size, shape, dtype, weight
format, numerics keys, UniEP version, cache schema) to a tuning string. The ops read it here, below
them; the search that writes it (``uniep.tune``) runs the ops, above them.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import re
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from .. import _C
from .params import parse as parse_tuning

__all__ = [
    "NUMERICS_KEYS",
    "SCHEDULE_KEYS",
    "WEIGHTS",
    "cache_key",
    "cache_mismatch_error",
    "cache_path",
    "call_with_cached_point",
    "device_name",
    "lookup",
    "normalize_numerics",
    "store",
    "tuning_for_call",
]

# 2: dispatch=fp8 runs fp8 experts (tuning key experts); a schema-1 entry for it named the tiles
# of bf16 expert GEMMs.
SCHEMA = 2
_KIND = "uniep-tune-cache"
NUMERICS_KEYS = ("dispatch", "combine", "gemm", "experts")
SCHEDULE_KEYS = (
    "sms",
    "token_tile",
    "tile_m",
    "tile_n",
    "tile_k",
    "stages",
    "cluster",
    "skip_rounds",
    "overlap",
)
# What tune() times: moe_forward on the weights as training holds them, or moe_forward_prepared on
# packed bf16 experts (the separate launches and the MegaKernel).
WEIGHTS = ("plain", "bf16_packed")
TUNABLE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


# ---- names, keys, paths ----


def name_of_dtype(dtype: torch.dtype | str) -> str:
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        if name in TUNABLE_DTYPES:
            return name
    elif isinstance(dtype, torch.dtype):
        for name, value in TUNABLE_DTYPES.items():
            if value == dtype:
                return name
    raise ValueError(f"dtype must be float32, bfloat16 or float64, got {dtype!r}")


def positive_int_arg(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


def normalize_numerics(numerics: str | _C.TuningParams = "") -> str:
    """``numerics`` (``dispatch``, ``combine``, ``gemm``, ``experts`` keys; the rest keep their
    defaults) in the canonical form ``"dispatch=bf16,combine=per_k,gemm=uniep"``, with
    ``",experts=bf16"`` after it only where it differs from ``experts=auto`` (bf16 experts on the
    fp8 dispatch's rows): one spelling per numerics.

    Raises:
        ValueError: a key other than these four (the tuner chooses the schedule keys), or a bad
            value (naming the key).
    """
    if isinstance(numerics, _C.TuningParams):
        p = numerics
    elif isinstance(numerics, str):
        for item in numerics.split(","):
            key = item.split("=", 1)[0].strip()
            if key and key not in NUMERICS_KEYS:
                raise ValueError(
                    f"numerics: key '{key}' is not a numerics key; numerics takes only "
                    f"{', '.join(NUMERICS_KEYS)} (the tuner chooses {', '.join(SCHEDULE_KEYS)})"
                )
        p = parse_tuning(numerics) if numerics.strip() else _C.TuningParams()
    else:
        raise ValueError(f"numerics must be a str, got {type(numerics).__name__}")
    text = f"dispatch={p.dispatch},combine={p.combine},gemm={p.gemm}"
    return text if p.fp8_experts == (p.dispatch == "fp8") else text + ",experts=bf16"


def numerics_of(tuning: str) -> str:
    return normalize_numerics(parse_tuning(tuning))


@functools.cache
def _cuda_device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def device_name(device: torch.device | str | None = None) -> str:
    """The name a cache key holds for ``device``: the GPU's name (``torch.cuda.get_device_name``)
    or ``"cpu-<machine>"`` (e.g. ``cpu-x86_64``)."""
    dev = torch.device("cpu" if device is None else device)
    if dev.type == "cuda":
        return _cuda_device_name(
            dev.index if dev.index is not None else torch.cuda.current_device()
        )
    if dev.type != "cpu":
        raise ValueError(f"device must be cpu or cuda, got {dev}")
    return f"cpu-{platform.machine() or 'unknown'}"


_device_name_of = device_name  # for the functions whose keyword device_name hides it


@functools.lru_cache(maxsize=1)
def _version() -> str:
    return str(_C.build_info()["version"])


def cache_path() -> Path:
    """Where winners are cached: ``UNIEP_TUNE_CACHE`` if set, else ``$XDG_CACHE_HOME/uniep/
    tune.json`` (an absolute ``XDG_CACHE_HOME`` only, as the XDG spec says), else
    ``~/.cache/uniep/tune.json``."""
    env = os.environ.get("UNIEP_TUNE_CACHE", "")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "uniep" / "tune.json"


def cache_key(
    *,
    device_name: str,
    world_size: int,
    tokens: int,
    hidden: int,
    ffn: int,
    experts: int,
    top_k: int,
    dtype: torch.dtype | str,
    numerics: str = "",
    weights: str = "plain",
) -> str:
    """The cache key of one shape: every field that may change the best point, the weight format
    (a ``weights=`` field unless ``"plain"``), the numerics keys, the UniEP version and the cache
    schema (``tokens``: per rank, ``x.shape[0]``)."""
    check_weights(weights)
    return "|".join(
        (
            f"schema={SCHEMA}",
            f"uniep={_version()}",
            f"device={device_name}",
            f"world={world_size}",
            f"tokens={tokens}",
            f"hidden={hidden}",
            f"ffn={ffn}",
            f"experts={experts}",
            f"top_k={top_k}",
            f"dtype={name_of_dtype(dtype)}",
            *(() if weights == "plain" else (f"weights={weights}",)),
            normalize_numerics(numerics),
        )
    )


def check_weights(weights: str) -> None:
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")


# ---- the cache file ----

# path -> ((mtime_ns, size, inode), {key: tuning}): moe_forward looks the cache up on every call
# with an empty tuning string, so the file is parsed (and its problems reported) once per version.
_MEMO: dict[str, tuple[tuple[int, int, int], dict[str, str]]] = {}


def _read_raw(path: Path) -> dict[str, Any]:
    """The file's entries, ``{}`` (with a warning naming the path) when it is not a cache of this
    schema; a missing file is an empty cache, silently."""

    def ignored(problem: str) -> dict[str, Any]:
        warnings.warn(
            f"uniep tune cache {path}: {problem}; ignoring it (uniep tune rewrites it, "
            "or delete it)",
            RuntimeWarning,
            stacklevel=2,
        )
        return {}

    try:
        text = path.read_text(encoding="utf-8")
    except (FileNotFoundError, NotADirectoryError):
        return {}
    except (OSError, UnicodeDecodeError) as e:
        return ignored(f"unreadable ({type(e).__name__}: {e})")
    try:
        data = json.loads(text)
    except ValueError as e:
        return ignored(f"not valid JSON ({e})")
    if not isinstance(data, dict) or data.get("kind") != _KIND:
        return ignored(f'not a UniEP tune cache (no "kind": "{_KIND}")')
    if data.get("schema") != SCHEMA:
        return ignored(f"schema {data.get('schema')!r}, this UniEP reads schema {SCHEMA}")
    entries = data.get("entries")
    if not isinstance(entries, dict):
        return ignored(f'"entries" must be an object, got {type(entries).__name__}')
    return entries


def _valid_entries(path: Path, entries: dict[str, Any]) -> dict[str, str]:
    good: dict[str, str] = {}
    for key, entry in entries.items():
        problem = None
        tuning = entry.get("tuning") if isinstance(entry, dict) else None
        if not isinstance(tuning, str):
            problem = 'no "tuning" string'
        else:
            try:
                numerics = numerics_of(tuning)
            except ValueError as e:
                problem = f"bad tuning {tuning!r} ({e})"
            else:
                if not key.endswith("|" + numerics):
                    problem = f"its tuning {tuning!r} changes the numerics keys of its key"
        if problem is not None:
            warnings.warn(
                f"uniep tune cache {path}: entry {key!r} skipped: {problem}",
                RuntimeWarning,
                stacklevel=2,
            )
            continue
        good[key] = tuning
    return good


def _load(path: Path) -> dict[str, str]:
    try:
        st = path.stat()
    except (FileNotFoundError, NotADirectoryError):
        _MEMO.pop(str(path), None)
        return {}
    except OSError:
        st = None
    stamp = (st.st_mtime_ns, st.st_size, st.st_ino) if st is not None else (-1, -1, -1)
    memo = _MEMO.get(str(path))
    if memo is not None and memo[0] == stamp and st is not None:
        return memo[1]
    entries = _valid_entries(path, _read_raw(path))
    _MEMO[str(path)] = (stamp, entries)
    return entries


def lookup(
    *,
    tokens: int,
    hidden: int,
    ffn: int,
    experts: int,
    top_k: int,
    dtype: torch.dtype | str,
    world_size: int = 1,
    device: torch.device | str | None = None,
    numerics: str = "",
    device_name: str | None = None,
    path: str | os.PathLike | None = None,
    weights: str = "plain",
) -> str | None:
    """The cached tuning string for this shape, or None.

    ``device_name`` (default: ``device_name(device)``), ``world_size`` and ``weights`` are part
    of the key;
    ``path`` defaults to ``cache_path()``. Never raises for the file's content: a corrupt,
    unreadable or foreign file warns and reads as empty, a bad entry warns and is skipped.
    """
    key = cache_key(
        device_name=_device_name_of(device) if device_name is None else device_name,
        world_size=world_size,
        tokens=tokens,
        hidden=hidden,
        ffn=ffn,
        experts=experts,
        top_k=top_k,
        dtype=dtype,
        numerics=numerics,
        weights=weights,
    )
    return _load(Path(path) if path is not None else cache_path()).get(key)


def store(
    tuning: str,
    *,
    tokens: int,
    hidden: int,
    ffn: int,
    experts: int,
    top_k: int,
    dtype: torch.dtype | str,
    world_size: int = 1,
    device: torch.device | str | None = None,
    numerics: str = "",
    device_name: str | None = None,
    path: str | os.PathLike | None = None,
    info: dict[str, Any] | None = None,
    weights: str = "plain",
) -> Path:
    """Cache ``tuning`` for this shape (the key as in ``lookup``) and return the file's path.

    The file is rewritten whole through a temporary file in its folder and a rename, so readers
    never see half a file; of two concurrent writers the last one wins. A corrupt or foreign file
    there is replaced (with the warning ``lookup`` gives). ``info`` (JSON values: times, counts)
    is kept next to the entry for people reading the file.

    Raises:
        ValueError: ``tuning`` does not parse, or its numerics keys differ from ``numerics``.
        OSError: the file cannot be written (naming it).
    """
    parsed = parse_tuning(tuning)
    if normalize_numerics(parsed) != normalize_numerics(numerics):
        raise ValueError(
            f"tuning {tuning!r} has numerics {normalize_numerics(parsed)!r} but the entry is for "
            f"{normalize_numerics(numerics)!r}: a cached point must keep the numerics keys"
        )
    name = _device_name_of(device) if device_name is None else device_name
    key = cache_key(
        device_name=name,
        world_size=world_size,
        tokens=tokens,
        hidden=hidden,
        ffn=ffn,
        experts=experts,
        top_k=top_k,
        dtype=dtype,
        numerics=numerics,
        weights=weights,
    )
    target = Path(path) if path is not None else cache_path()
    entries = dict(_read_raw(target))
    entry: dict[str, Any] = {"tuning": parsed.to_string()}
    entry.update(info or {})
    entry["stored"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    entries[key] = entry
    payload = {"kind": _KIND, "schema": SCHEMA, "entries": entries}
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tune-", suffix=".tmp", dir=target.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(payload, f, indent=1, sort_keys=True)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            _unlink_quietly(tmp)
            raise
    except OSError as e:
        raise OSError(f"could not write the uniep tune cache {target}: {e}") from e
    _MEMO.pop(str(target), None)
    return target


def _unlink_quietly(name: str) -> None:
    try:
        os.unlink(name)
    except OSError:
        pass


def tuning_for_call(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    ffn: int,
    experts: int,
    world_size: int,
    weights: str = "plain",
) -> str:
    """What ``moe_forward`` (``moe_forward_prepared`` with ``weights``) runs with for an empty
    tuning string: the cached point for this call's shape (``tokens = x.shape[0]``, default
    numerics), else ``""`` (the built-in default).

    Not under ``torch.compile`` (a file read is no graph op: compiled code runs the default).
    Every rank must see the same cache file: a rank that finds another point than its peers
    makes the call agreement of ``moe_forward`` raise on every rank, naming the tuning key.
    """
    if torch.compiler.is_compiling() or x.dim() != 2 or topk_idx.dim() != 2:
        return ""
    if x.dtype not in TUNABLE_DTYPES.values() or x.device.type not in ("cpu", "cuda"):
        return ""
    hit = lookup(
        tokens=x.shape[0],
        hidden=x.shape[1],
        ffn=ffn,
        experts=experts,
        top_k=topk_idx.shape[1],
        dtype=x.dtype,
        world_size=world_size,
        device=x.device,
        weights=weights,
    )
    return hit or ""


_T = TypeVar("_T")


def call_with_cached_point(
    run: Callable[[str], _T],
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    ffn: int,
    experts: int,
    world_size: int,
) -> _T:
    """``run(tuning)`` with the point :func:`tuning_for_call` finds for this call (``""``: none).

    Each rank looks up its own token count, so ranks with ragged batches (a point cached for one
    rank's tokens and not for another's), or ranks that read different cache files, find
    different points; the call's agreement then raises on every rank naming a tuning key, and
    here the error says where this rank's point came from (:func:`cache_mismatch_error`). A
    retry with the defaults is not safe to make alone: a peer that passed its own tuning string
    raised and left. Any other error is raised as it is.
    """
    tuning = tuning_for_call(x, topk_idx, ffn, experts, world_size)
    try:
        return run(tuning)
    except ValueError as e:
        hinted = cache_mismatch_error(e, tuning)
        if hinted is None:
            raise
        raise hinted from e


def cache_mismatch_error(error: ValueError, used: str) -> ValueError | None:
    """For a call that ran with ``used`` because its tuning string was ``""``: when the call
    agreement failed on a tuning key, the same error saying where that point came from (ranks
    that read different cache files pick different points); None for any other error."""
    if not re.search(r"tuning [\w ()]+ differs", str(error)):
        return None
    path = cache_path()
    source = (
        f"the point cached in the uniep tune cache {path}"
        if used
        else f"the defaults (the uniep tune cache {path} has no entry for this shape)"
    )
    return ValueError(
        f'{error}\n(this rank was called with tuning "" and so ran {source}; each rank looks up '
        "its own token count, so ranks with ragged batches can find different points, and every "
        "rank must see the same tune cache file: copy it, set UNIEP_TUNE_CACHE, or pass a "
        "tuning string, which chooses one point for every rank)"
    )
