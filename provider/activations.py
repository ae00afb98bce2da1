"""Activations in inspect logs: encode a result's arrays into `ModelOutput.metadata`, read them back.

Metadata written by the `capserve` provider for a call that captured (all JSON, so it survives
into the .eval log; numpy arrays would be logged as null):

    "activations":          {"<layer>:<kind>": {"dtype", "shape", "data": base64}}   # inline
                            {"<layer>:<kind>": {"dtype", "shape", "path", "tensor"}} # in a file
    "activation_hooks":     hook names as requested, in request order
    "activation_positions": absolute token positions of the rows (omitted rows when reduced)
    "activation_token_ids": the tokens at those positions
    "activation_reduce":    "none" | "mean"
    "logits", "logits_positions": the same array entry and rows, when logits were asked for
    "sae":                  {"<sae_id>": {"hook", "positions", "ids", "values", "error"}}, SAE
                            features (replicas.api.SaeFeatures), arrays inline as above (they are small)
    "readouts":             [{"kind", "hook", "probe", "positions", "ids", "logprobs", "tokens", "values"}],
                            lenses and probes in the request's order (replicas.api.ReadoutResult), inline

Keys are TransformerLens's wire keys (`"1:resid_post"`; the final norm keeps its full name
`"ln_final.hook_normalized"`) and inline entries use its `{"data", "dtype", "shape"}` format
(`replicas.api.arrays`), so TransformerLens's log readers work on them. Arrays larger than the inline
limit in total (or every capture, when a capture directory is set) go to one safetensors file per
call, tensors named by wire key; the metadata then holds the file's absolute path.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from replicas.api import arrays
from replicas.api.hooks import resolve_hook

if TYPE_CHECKING:
    from inspect_ai.log import EvalLog, EvalSample
    from inspect_ai.model import ModelOutput

    from replicas.api import GenerateResult

DEFAULT_INLINE_BYTES = 256 << 10
DEFAULT_CAPTURE_DIR = Path("logs") / "capserve-activations"
LOGITS = "logits"  # the logits tensor's name in a file

# safetensors dtype names <-> the array format's names (bfloat16 is stored as BF16, which
# safetensors.numpy cannot load, so files are read here directly).
_ST_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32"}


def wire_key(hook: str) -> str:
    """TransformerLens's `"<layer>:<kind>"` key of any accepted hook spelling."""
    return resolve_hook(hook).wire_key


def result_metadata(
    result: GenerateResult,
    hooks: list[str],
    reduce: str = "none",
    *,
    inline_bytes: int = DEFAULT_INLINE_BYTES,
    capture_dir: str | os.PathLike[str] | None = None,
) -> tuple[dict[str, Any], dict[str, np.ndarray] | None]:
    """The JSON-safe metadata for a result's activations (and logits), and the arrays to write.

    Returns `(metadata, None)` when the arrays are inline, or `(metadata, tensors)` when they go
    to the file named in the metadata (`file_of(metadata)`): write them with `write_tensors`
    before the metadata is handed to anyone. A `capture_dir` means files always.
    """
    keys = [wire_key(h) for h in hooks]
    if len(set(keys)) != len(keys):
        raise ValueError(f"capture hooks {hooks} name the same hook point twice; keep one spelling each")
    tensors = {key: result.activations[hook] for hook, key in zip(hooks, keys)}
    meta: dict[str, Any] = {}
    if hooks:
        meta.update(
            activation_hooks=list(hooks),
            activation_positions=list(result.positions),
            activation_token_ids=list(result.capture_token_ids),
            activation_reduce=reduce,
        )
    if result.logits is not None:
        tensors[LOGITS] = result.logits
        meta["logits_positions"] = list(result.logits_positions)
    total = sum(a.nbytes for a in tensors.values())
    if capture_dir is None and total <= inline_bytes:
        encoded = {key: dict(arrays.to_base64(a)) for key, a in tensors.items()}
        written = None
    else:
        folder = Path(capture_dir if capture_dir is not None else DEFAULT_CAPTURE_DIR).expanduser().resolve()
        path = str(folder / f"{_safe_name(result.request_id)}.safetensors")
        encoded = {
            key: {"dtype": arrays.dtype_name(a), "shape": list(a.shape), "path": path, "tensor": key}
            for key, a in tensors.items()
        }
        written = tensors
    logits = encoded.pop(LOGITS, None)
    if result.sae:
        meta["sae"] = {sae_id: features.model_dump(mode="json") for sae_id, features in result.sae.items()}
    if result.readouts:
        meta["readouts"] = [readout.model_dump(mode="json") for readout in result.readouts]
    if hooks:
        meta["activations"] = encoded
    if logits is not None:
        meta["logits"] = logits
    return meta, written


def file_of(metadata: Mapping[str, Any]) -> str:
    """The safetensors file a `result_metadata` points to."""
    entries = [*(metadata.get("activations") or {}).values(), metadata.get("logits") or {}]
    return next(e["path"] for e in entries if "path" in e)


def write_tensors(path: str | os.PathLike[str], tensors: Mapping[str, np.ndarray]) -> None:
    """Write a safetensors file atomically (a reader never sees half a file)."""
    from safetensors.numpy import save_file

    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(tmp), metadata={"writer": "capserve"})
    os.replace(tmp, target)


def read_tensors(path: str | os.PathLike[str], names: list[str] | None = None) -> dict[str, np.ndarray]:
    """Read a safetensors file into numpy, bfloat16 included (as `ml_dtypes.bfloat16`)."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
        start = 8 + header_len
        out: dict[str, np.ndarray] = {}
        for name, entry in header.items():
            if name == "__metadata__" or (names is not None and name not in names):
                continue
            dtype = _ST_DTYPES.get(entry["dtype"])
            if dtype is None:
                raise ValueError(f"{path}: tensor {name!r} has dtype {entry['dtype']}; capserve reads {sorted(_ST_DTYPES)}")
            begin, end = entry["data_offsets"]
            f.seek(start + begin)
            raw = {"dtype": dtype, "shape": entry["shape"], "data": f.read(end - begin)}
            out[name] = arrays.from_raw(raw).copy()
    if names is not None and (missing := set(names) - out.keys()):
        raise KeyError(f"{path} has no tensor(s) {sorted(missing)}; it holds {sorted(out)}")
    return out


def decode_activations(
    metadata: Mapping[str, Any] | None,
    capture_dir: str | os.PathLike[str] | None = None,
    by: str = "hook",
) -> dict[str, np.ndarray]:
    """Arrays from the metadata of one model call (see the module docstring).

    `by="hook"` keys them by the hook names as requested (`activation_hooks`); `by="wire"` by
    wire key. Arrays stored in files are loaded from the recorded path, or, when the files were
    moved, from `capture_dir` / the file's name.
    """
    if by not in ("hook", "wire"):
        raise ValueError(f"by={by!r}; allowed: 'hook', 'wire'")
    entries = (metadata or {}).get("activations")
    if not entries:
        raise LookupError(
            "this model call has no activations in its metadata; run the eval with "
            "-M capture=<hooks> (or extra_body={'capture': {...}})"
        )
    out: dict[str, np.ndarray] = {}
    files: dict[str, list[str]] = {}
    for key, entry in entries.items():
        if "data" in entry:
            out[key] = arrays.from_raw(entry)
        else:
            files.setdefault(_locate(entry["path"], capture_dir), []).append(entry.get("tensor", key))
    for path, names in files.items():
        out.update(read_tensors(path, names))
    out = {key: out[key] for key in entries}  # request order
    hooks = (metadata or {}).get("activation_hooks")
    if by == "wire" or not hooks:
        return out
    return {hook: out[wire_key(hook)] for hook in hooks}


def read_activations(
    source: str | os.PathLike[str] | EvalLog | EvalSample | ModelOutput | Mapping[str, Any],
    sample_id: int | str | None = None,
    epoch: int = 1,
    *,
    call: int = -1,
    capture_dir: str | os.PathLike[str] | None = None,
    by: str = "hook",
) -> dict[str, np.ndarray]:
    """A sample's captured activations as numpy arrays, from an inspect eval log.

    `source`: a log file path, an `EvalLog`, an `EvalSample`, a `ModelOutput` or its metadata.
    For a log, `sample_id` (and `epoch`) pick the sample; it may be left out when the log holds
    one sample. `call` picks the model call within the sample (default -1: the last, which is
    `sample.output`; 0 the first, for multi-turn solvers). Arrays are keyed by hook name as
    requested (`by="wire"`: by `"<layer>:<kind>"`); rows are `activation_positions`.
    """
    return decode_activations(_metadata_of(source, sample_id, epoch, call), capture_dir, by)


def read_logits(
    source: str | os.PathLike[str] | EvalLog | EvalSample | ModelOutput | Mapping[str, Any],
    sample_id: int | str | None = None,
    epoch: int = 1,
    *,
    call: int = -1,
    capture_dir: str | os.PathLike[str] | None = None,
) -> np.ndarray:
    """Logits asked for with `extra_body={"logits": {...}}`: float32 [n_positions, d_vocab]
    (rows at `logits_positions`). Arguments as for `read_activations`."""
    entry = (_metadata_of(source, sample_id, epoch, call) or {}).get("logits")
    if not entry:
        raise LookupError("this model call has no logits in its metadata; ask with extra_body={'logits': {...}}")
    if "data" in entry:
        return arrays.from_raw(entry)
    return read_tensors(_locate(entry["path"], capture_dir), [entry.get("tensor", LOGITS)])[entry.get("tensor", LOGITS)]


def activation_info(
    source: str | os.PathLike[str] | EvalLog | EvalSample | ModelOutput | Mapping[str, Any],
    sample_id: int | str | None = None,
    epoch: int = 1,
    *,
    call: int = -1,
) -> dict[str, Any]:
    """The call's metadata without the arrays: hooks, positions, token ids, replica."""
    meta = _metadata_of(source, sample_id, epoch, call) or {}
    return {k: v for k, v in meta.items() if k not in ("activations", "logits")}


# ---------------------------------------------------------------- internals


def _metadata_of(source: Any, sample_id: int | str | None, epoch: int, call: int) -> Mapping[str, Any] | None:
    if isinstance(source, Mapping):
        return source
    from inspect_ai.log import EvalLog, EvalSample, read_eval_log, read_eval_log_sample
    from inspect_ai.model import ModelOutput

    if isinstance(source, ModelOutput):
        return source.metadata
    if isinstance(source, (str, os.PathLike)):
        if sample_id is None:
            source = read_eval_log(source)
        else:
            source = read_eval_log_sample(source, id=sample_id, epoch=epoch)
    if isinstance(source, EvalLog):
        source = _pick_sample(source, sample_id, epoch)
    if not isinstance(source, EvalSample):
        raise TypeError(f"cannot read activations from a {type(source).__name__}")
    if call == -1 and source.output is not None and source.output.metadata:
        return source.output.metadata
    outputs = [e.output for e in source.events if getattr(e, "event", None) == "model" and e.output is not None]
    if not outputs:
        raise LookupError(f"sample {source.id} (epoch {source.epoch}) has no model calls")
    try:
        return outputs[call].metadata
    except IndexError:
        raise IndexError(f"call={call}: sample {source.id} made {len(outputs)} model calls") from None


def _pick_sample(log: EvalLog, sample_id: int | str | None, epoch: int) -> EvalSample:
    samples = log.samples or []
    if sample_id is None:
        if len(samples) != 1:
            raise ValueError(f"the log holds {len(samples)} samples; pass sample_id (and epoch)")
        return samples[0]
    for sample in samples:
        if sample.id == sample_id and sample.epoch == epoch:
            return sample
    raise LookupError(f"no sample id={sample_id!r} epoch={epoch} in the log")


def _locate(path: str, capture_dir: str | os.PathLike[str] | None) -> str:
    if capture_dir is not None:
        moved = Path(capture_dir) / Path(path).name
        if moved.exists():
            return str(moved)
    if Path(path).exists():
        return path
    raise FileNotFoundError(
        f"activation file {path} is missing; if the files were moved, pass capture_dir=<their folder>"
    )


def _safe_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "capture"
