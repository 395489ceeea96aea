"""Checkpoints: per worker, weights and optimizer state as safetensors plus msgpack metadata.

    ckpt/step_00000010/w0.safetensors    param.<name>, exp_avg.<name>, exp_avg_sq.<name> (no
                                         optimizer state for a tied parameter's copy; with
                                         ZeRO-1 the moments of the worker's shard only: 1-D
                                         segments of the flattened parameters)
    ckpt/step_00000010/w0.msgpack        {step, build, lineage, data_position, opt_steps, rng;
                                         zero: the shard layout, executor/zero.py}
    ckpt/step_00000010/COMPLETE          JSON, written by h2x once every worker's files are durable:
                                         {format, step, build, lineage, files: {name: {sha256,
                                         size}}}
    ckpt/.h2x-ckpt.lock                  the run writing here (executor/rundir.py RunLock)

What is guaranteed:
- A worker removes the step directory's COMPLETE (and syncs the directory) before it writes any
  file there, so a run that stops while rewriting a step leaves a directory without COMPLETE,
  which resume skips — never a mix of two runs' files under an old COMPLETE.
- Each file is written to `NAME.tmp`, fsynced, renamed, and the directory fsynced; the worker
  reports the file's sha256 and size, and the launcher writes COMPLETE (the same way) only after
  every worker reported. What a killed writer leaves — a `.tmp`, or safetensors' own `.tmpXXXXXX`
  inside it — is removed by the next run that locks the directory (never while another run
  holds it: its files in flight are not partial).
- A checkpoint is bound to its step, its build and its run: the directory's name, COMPLETE and
  every worker's metadata record the same step, the same build fingerprint (`build_fingerprint`)
  and the same lineage (a fresh run's random id, kept by every run resumed from it:
  `run_identity`). A renamed or copied step directory, or worker files of another run or build,
  are skipped with a note.
- Resume checks every file against its recorded size and sha256; a missing, truncated or changed
  file is named, and the previous complete checkpoint is tried; so is a checkpoint of another
  build (a directory several builds share).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
from pathlib import Path

import msgpack
import numpy as np

from h2ir.errors import H2Error

FORMAT = "h2-ckpt/2"        # 2: step, build and lineage in every worker's metadata
MARKER = "COMPLETE"
_CHUNK = 1 << 20
_WRITE_CHUNK = 256 << 10     # within a core's L2: hashing it after writing it reads no memory
MAX_META_BYTES = 64 << 20   # a worker's msgpack metadata (ZeRO segments, MoE placements)
# safetensors writes NAME through a temporary file of its own in the same directory
# (the tempfile crate's `.tmp` and six random characters), then renames it
_SAFETENSORS_TMP = re.compile(r"\.tmp[A-Za-z0-9]{6}")


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def worker_files(wid: int) -> tuple[str, str]:
    return f"w{wid}.safetensors", f"w{wid}.msgpack"


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _digest(f) -> tuple[str, int]:
    h, n = hashlib.sha256(), 0
    while chunk := f.read(_CHUNK):
        h.update(chunk)
        n += len(chunk)
    return h.hexdigest(), n


def file_digest(path: Path) -> dict:
    with open(path, "rb") as f:
        sha, size = _digest(f)
    return {"sha256": sha, "size": size}


# numpy dtype -> safetensors' dtype name (bf16 travels as its uint16 bits, as the backends hand it)
_ST_DTYPES = {np.dtype(t): n for t, n in (
    (np.float64, "F64"), (np.float32, "F32"), (np.float16, "F16"), (np.int64, "I64"),
    (np.int32, "I32"), (np.int16, "I16"), (np.int8, "I8"), (np.uint64, "U64"), (np.uint32, "U32"),
    (np.uint16, "U16"), (np.uint8, "U8"), (np.bool_, "BOOL"))}


def write_safetensors(path: Path, tensors: dict) -> tuple[str, int]:
    """Write `tensors` as a safetensors file straight from their memory, hashing the bytes as
    they go out; returns (sha256, size). The format: an 8-byte header length, a JSON header
    padded to 8 bytes, the arrays back to back (widest items first, so each is aligned).
    safetensors' own writer copies every array into one buffer first: a checkpoint's size in
    CPU time and memory that a background writer would take from the step beside it."""
    arrays = sorted(((k, np.require(v, requirements="C")) for k, v in tensors.items()),
                    key=lambda kv: (-kv[1].dtype.itemsize, kv[0]))
    header, pos = {}, 0
    for k, a in arrays:
        if a.dtype not in _ST_DTYPES:
            raise ValueError(f"tensor {k}: no safetensors dtype for numpy {a.dtype}")
        header[k] = {"dtype": _ST_DTYPES[a.dtype], "shape": list(a.shape),
                     "data_offsets": [pos, pos + a.nbytes]}
        pos += a.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    head = len(raw).to_bytes(8, "little") + raw
    h = hashlib.sha256(head)
    with open(path, "wb") as f:
        f.write(head)
        for _, a in arrays:
            data = memoryview(a.reshape(-1).view(np.uint8))
            for i in range(0, len(data), _WRITE_CHUNK):    # hashed while still in the cache
                f.write(data[i:i + _WRITE_CHUNK])
                h.update(data[i:i + _WRITE_CHUNK])
    return h.hexdigest(), len(head) + pos


def _durable_write(path: Path, write, hashed: bool = False) -> dict:
    """write(tmp) a whole file, fsync it, rename it over `path`, fsync the directory; returns the
    file's {sha256, size}: with `hashed`, what `write` returned as (sha256, size) of the bytes
    it wrote, else of the bytes read back. No `.tmp` stays behind on an error."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        got = write(tmp)
        got = got if hashed else None
        with open(tmp, "rb") as f:
            if got is None:
                got = _digest(f)
            elif os.fstat(f.fileno()).st_size != got[1]:
                raise OSError(f"{tmp.name} holds {os.fstat(f.fileno()).st_size} bytes after "
                              f"{got[1]} were written")
            sha, size = got
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException as e:
        try:
            tmp.unlink()
        except OSError:
            pass
        if isinstance(e, Exception):     # OSError, or safetensors' own error type
            raise write_error(path.parent, e, path) from None
        raise
    return {"sha256": sha, "size": size}


def write_error(d: Path, e: Exception, path: Path | None = None) -> H2Error:
    """A failed write of checkpoint directory `d` (its file `path`) as a run error naming them
    and the cause; that step never gets its COMPLETE, so --resume takes an earlier one."""
    from executor.oserrors import os_error_cause, os_error_hint
    os_err = isinstance(e, OSError)
    cause = os_error_cause(e) if os_err else f"{type(e).__name__}: {e}"
    hint = "; ".join(h for h in ((os_error_hint(e) if os_err else None),
                                 "--resume takes the newest complete checkpoint") if h)
    what = path.name if path is not None else "its directory"
    return H2Error(f"cannot write checkpoint {d.name} ({what}): {cause}", str(path or d),
                   hint=hint)


def invalidate(d: Path) -> None:
    """Make `d` not a complete checkpoint, durably, before anything in it is rewritten."""
    try:
        (d / MARKER).unlink()
    except FileNotFoundError:
        return
    _fsync_dir(d)


def snapshot(worker, step: int) -> tuple[dict, dict]:
    """(tensors, metadata) of this worker's checkpoint of `step`, copied out of the live tables
    (the next step's optimizer updates them in place while a background writer saves these)."""
    be = worker.be
    # the copies go into buffers kept from the last snapshot (its write has ended: the caller
    # waits for it): fresh ones would cost a page fault per 4 KiB on every checkpoint
    buffers = getattr(worker, "_snapshot_buffers", None)
    if buffers is None:
        buffers = {}
        setattr(worker, "_snapshot_buffers", buffers)

    def copy(name: str, t) -> np.ndarray:
        src = be.to_numpy(t)
        dst = buffers.get(name)
        if dst is None or dst.shape != src.shape or dst.dtype != src.dtype:
            dst = buffers[name] = np.empty(src.shape, src.dtype)
        np.copyto(dst, src)
        return dst
    tensors = {f"param.{k}": copy(f"param.{k}", worker.params[k]) for k in worker.param_names}
    # a tied parameter's copy has no optimizer state of its own, a ZeRO-1 worker only its shard's
    for k in worker.opt_names:
        if k in worker.exp_avg:
            tensors[f"exp_avg.{k}"] = copy(f"exp_avg.{k}", worker.exp_avg[k])
            tensors[f"exp_avg_sq.{k}"] = copy(f"exp_avg_sq.{k}", worker.exp_avg_sq[k])
    # Data is a pure function of (seed, step, replica, micro-batch): the next step is the position;
    # the per-source sample counts and epochs are recorded beside it for a reader
    run = (getattr(worker, "opt", None) or {}).get("run") or {}
    meta = {"step": step, "build": run.get("build"), "lineage": run.get("lineage"),
            "data_position": step, "opt_steps": worker.opt_steps, "rng": None,
            "worker": worker.wid, "stage": worker.stage_idx,
            "skipped_in_row": getattr(worker, "skipped_in_row", 0)}
    data = _data_of(worker)
    if data is not None:
        meta["data"] = data.position(step)
    zero = zero_layout(worker)
    if zero:
        meta["zero"] = zero
    moe = getattr(worker, "moe", None)
    if moe:                          # expert placement after migrations (executor/experts.py)
        meta["moe_placement"] = {p: list(o) for p, o in moe.placement.items()}
        meta["moe_load_ema"] = {p: [float(x) for x in v] for p, v in moe.load_ema.items()}
    return tensors, meta


def _data_of(worker):
    """The batches a worker draws (a virtual-stage worker's: its chunks'), or None."""
    return getattr(worker, "data", None) or next(
        (ch.data for ch in getattr(worker, "chunks", ()) if ch.data is not None), None)


def data_note(meta: dict, worker, d: Path) -> str | None:
    """A note when the run resumes checkpoint `d` with other data than it was written with:
    other sources, windows, global batch or order (the samples then are not the ones the
    checkpointed run would have drawn next)."""
    data, then = _data_of(worker), meta.get("data")
    if data is None or not isinstance(then, dict):
        return None
    now = data.position(int(meta["step"]))

    def shown(p: dict) -> str:
        srcs = p.get("sources") if isinstance(p.get("sources"), list) else []
        return ", ".join(f"{s.get('name')} ({s.get('windows')} windows)" for s in srcs
                         if isinstance(s, dict)) + \
            f"; global batch {p.get('global_batch')}, " + \
            ("shuffled" if p.get("shuffle") else "in order")
    if shown(then) == shown(now):
        return None
    return (f"note: resuming {d.name} with other data than it was written with (then: "
            f"{shown(then)}; now: {shown(now)}); the run continues on the new data")


def zero_layout(worker) -> dict | None:
    """The ZeRO-1 shard layouts of a worker ({chunk prefix + name: [lo, hi]} segments, its
    index and the dp group's size), or None without ZeRO-1."""
    parts = [(f"c{c}." if hasattr(worker, "chunks") else "", ch.zero)
             for c, ch in enumerate(getattr(worker, "chunks", [worker]))]
    parts = [(p, z) for p, z in parts if z is not None]
    if not parts:
        return None
    return {"dp": parts[0][1].dp, "rank": parts[0][1].rank,
            "segments": {p + k: seg for p, z in parts for k, seg in z.layout()["segments"].items()}}


def write_snapshot(root: Path, step: int, wid: int, tensors: dict, meta: dict) -> dict:
    """Write a worker's snapshot as its files of checkpoint `step`, each durable when this
    returns; returns {file name: {sha256, size}} for the launcher's COMPLETE record. Weights or
    optimizer state that are not finite raise `NonFinite` and nothing is written: the launcher
    never marks that step complete."""
    bad = [k for k, v in tensors.items() if not _all_finite(v)]
    if bad:
        raise NonFinite(bad)
    root = Path(root)
    d = step_dir(root, step)
    try:
        if not d.is_dir():
            d.mkdir(parents=True, exist_ok=True)
            _fsync_dir(root)
        invalidate(d)
    except OSError as e:
        raise write_error(d, e) from None
    st_name, mp_name = worker_files(wid)
    files = {st_name: _durable_write(d / st_name, lambda p: write_safetensors(p, tensors),
                                         hashed=True)}
    files[mp_name] = _durable_write(d / mp_name, lambda p: p.write_bytes(msgpack.packb(meta)))
    return files


def _all_finite(a: np.ndarray) -> bool:
    """Every element finite; a finite sum proves it in one pass without a temporary (a sum that
    overflowed is checked element by element)."""
    return a.dtype.kind != "f" or bool(np.isfinite(a.sum())) or bool(np.isfinite(a).all())


def save_worker_checkpoint(root: Path, step: int, worker) -> dict:
    """snapshot + write_snapshot in one call (the worker's own path writes in the background)."""
    tensors, meta = snapshot(worker, step)
    return write_snapshot(root, step, worker.wid, tensors, meta)


class NonFinite(Exception):
    def __init__(self, names: list[str]):
        super().__init__(", ".join(names[:3]) + (" ..." if len(names) > 3 else ""))
        self.names = names


def load_worker_checkpoint(d: Path, worker) -> dict:
    """Load this worker's files of checkpoint `d` (verified by the launcher) into `worker`;
    returns its metadata. Worker 0 notes data other than the checkpoint's (`data_note`)."""
    from safetensors.numpy import load_file
    st_name, mp_name = worker_files(worker.wid)
    f, mf = d / st_name, d / mp_name
    try:
        tensors = load_file(str(f))
    except Exception as e:          # safetensors raises its own error type for a bad header
        raise H2Error(f"cannot read checkpoint file: {e}", str(f)) from None
    try:
        meta = _read_meta(mf)
        opt_steps = int(meta["opt_steps"])
    except Exception as e:
        raise H2Error(f"cannot read checkpoint metadata: {type(e).__name__}: {e}", str(mf)) from None
    be = worker.be
    zero = zero_layout(worker)
    if (meta.get("zero") or None) != zero:
        raise H2Error(f"checkpoint's ZeRO-1 layout ({_zero_text(meta.get('zero'))}) is not this "
                      f"worker's ({_zero_text(zero)})", str(mf),
                      hint="lay the checkpoint out for this build with `h2x reshard`")
    wanted = [(worker.params, "param.", k) for k in worker.param_names]
    # the moments the worker holds: whole per parameter, or its ZeRO-1 segments
    wanted += [(table, prefix, k) for k in worker.opt_names if k in worker.exp_avg
               for table, prefix in ((worker.exp_avg, "exp_avg."),
                                     (worker.exp_avg_sq, "exp_avg_sq."))]
    for table, prefix, k in wanted:
        if prefix + k not in tensors:
            raise H2Error(f"checkpoint has no tensor {prefix + k}", str(f))
        arr = tensors[prefix + k]
        have = tuple(table[k].shape)
        if tuple(arr.shape) != have:
            raise H2Error(f"checkpoint tensor {prefix + k} has shape {list(arr.shape)}, this "
                          f"worker holds {list(have)}", str(f))
        table[k] = be.from_numpy(np.array(arr), "f32")
    worker.opt_steps = opt_steps
    worker.skipped_in_row = int(meta.get("skipped_in_row", 0))
    placement = meta.get("moe_placement")
    moe = getattr(worker, "moe", None)
    if placement and moe:
        if set(placement) != set(moe.placement) or any(
                sorted(placement[p]) != sorted(moe.placement[p]) for p in placement):
            raise H2Error("checkpoint's expert placement does not fit this build's MoE layers",
                          str(mf))
        moe.placement = {p: [int(e) for e in o] for p, o in placement.items()}
        moe.step_placement = {p: list(o) for p, o in moe.placement.items()}
        moe.load_ema = {p: [float(x) for x in v]
                        for p, v in (meta.get("moe_load_ema") or {}).items()}
        worker.set_placement_consts(moe.placement)
    note = data_note(meta, worker, d) if worker.wid == 0 else None
    emit = getattr(worker, "emit", None)
    if note and emit is not None:
        emit({"event": "log", "text": note})
    return meta


def _read_meta(mf: Path) -> dict:
    """A worker's msgpack metadata, read within MAX_META_BYTES (a dict, or ValueError)."""
    with open(mf, "rb") as fh:
        raw = fh.read(MAX_META_BYTES + 1)
    if len(raw) > MAX_META_BYTES:
        raise ValueError(f"larger than {MAX_META_BYTES >> 20} MiB")
    meta = msgpack.unpackb(raw)
    if not isinstance(meta, dict):
        raise ValueError(f"not a map (got {type(meta).__name__})")
    return meta


def _zero_text(z: dict | None) -> str:
    return "none" if not z else f"shard {z.get('rank')} of dp {z.get('dp')}"


def build_fingerprint(build_path: Path) -> str:
    """What a checkpoint must match to be resumed: the digest of the build's manifest, stage
    programs and signatures, and worker streams. (The initial weights are left out: they follow
    from the manifest's model digest, arguments and seed, and a checkpoint replaces them.)"""
    build_path = Path(build_path)
    files = [build_path / "manifest.json"]
    files += sorted((build_path / "stages").glob("*"))
    files += sorted((build_path / "streams").glob("w*.txt"))
    h = hashlib.sha256()
    for f in files:
        if f.is_file():
            data = f.read_bytes()
            h.update(f"{f.relative_to(build_path)}\0{len(data)}\0".encode())
            h.update(data)
    return h.hexdigest()


def mark_complete(root: Path, step: int, fingerprint: str, reports: dict[int, dict]) -> None:
    """COMPLETE for `step`, once every worker reported its files' digests ({wid: {name: {sha256,
    size}}}); a reported file that is not there with its size is a bug or a disk problem, and
    so is a worker's metadata that names another step, build or run than its peers'."""
    d = step_dir(root, step)
    files, lineages = {}, set()
    for wid in sorted(reports):
        for name, dig in reports[wid].items():
            p = d / name
            try:
                size = p.stat().st_size
            except OSError as e:
                raise H2Error(f"checkpoint file vanished before COMPLETE was written: {e.strerror}",
                              str(p)) from None
            if size != dig["size"]:
                raise H2Error(f"checkpoint file is {size} bytes, its worker wrote {dig['size']}",
                              str(p))
            files[name] = {"sha256": dig["sha256"], "size": dig["size"]}
        mf = d / worker_files(wid)[1]
        try:
            meta = _read_meta(mf)
        except Exception as e:          # OSError, or msgpack's own error types
            raise H2Error(f"cannot read checkpoint metadata: {type(e).__name__}: {e}",
                          str(mf)) from None
        if meta.get("step") != step or meta.get("build") != fingerprint:
            raise H2Error(f"worker w{wid}'s checkpoint metadata records step "
                          f"{_short(meta.get('step'))} of build {_short(meta.get('build'))}; this "
                          f"run writes step {step} of build {fingerprint[:12]}", str(mf))
        lineages.add(meta.get("lineage"))
    if len(lineages) > 1:
        raise H2Error(f"the workers' files of step {step} record different runs (lineages "
                      f"{', '.join(sorted(map(str, lineages)))})", str(d))
    record = {"format": FORMAT, "step": step, "build": fingerprint,
              "lineage": lineages.pop() if lineages else None, "workers": sorted(reports),
              "files": files}
    _durable_write(d / MARKER, lambda p: p.write_text(json.dumps(record, indent=1) + "\n"))


def run_identity(fingerprint: str, resume_from: Path | None) -> dict:
    """What binds a run's checkpoints to it ({"build", "lineage"}, the workers' recipe `run`):
    the build's fingerprint, and the lineage of the checkpoint resumed from, else a fresh one."""
    lineage = None
    if resume_from is not None:
        record = _record(Path(resume_from) / MARKER)
        lineage = record.get("lineage") if isinstance(record, dict) else None
    return {"build": fingerprint, "lineage": lineage or secrets.token_hex(8)}


def _record(marker: Path):
    """A COMPLETE record as JSON (read within MAX_META_BYTES); None when it is unreadable."""
    try:
        with open(marker, "rb") as fh:
            raw = fh.read(MAX_META_BYTES + 1)
        return json.loads(raw) if len(raw) <= MAX_META_BYTES else None
    except (OSError, ValueError, RecursionError):
        return None


def _short(v) -> str:
    text = repr(v)
    return text if len(text) <= 24 else text[:21] + "..."


def _steps(root: Path) -> list[tuple[int, Path]]:
    found = []
    for d in Path(root).glob("step_*"):
        try:
            found.append((int(d.name.split("_", 1)[1]), d))
        except ValueError:
            continue
    return sorted(found, reverse=True)


def prune(root: Path, keep_last: int, fingerprint: str | None = None) -> list[Path]:
    """Delete the complete checkpoints older than the newest `keep_last` (0: none deleted);
    returns the directories removed. Only directories with COMPLETE count and go, and with
    `fingerprint` only that build's (another build sharing the directory keeps its own): a
    partial one is left for remove_partial_writes and the next run."""
    import shutil
    if keep_last <= 0:
        return []
    done = [d for _, d in _steps(Path(root)) if (d / MARKER).is_file() and
            (fingerprint is None or (_record(d / MARKER) or {}).get("build") == fingerprint)]
    gone = []
    for d in done[keep_last:]:          # newest first
        invalidate(d)                    # never a half-deleted directory under COMPLETE
        shutil.rmtree(d, ignore_errors=True)
        gone.append(d)
    return gone


def complete_steps(root: Path) -> list[int]:
    root = Path(root)
    return [s for s, d in _steps(root) if (d / MARKER).is_file()] if root.is_dir() else []


class Unusable(Exception):
    """Why one checkpoint cannot be resumed from: the file at fault and what is wrong with it."""

    def __init__(self, file: Path, why: str):
        super().__init__(file, why)
        self.file, self.why = file, why

    def __str__(self) -> str:
        return f"{self.file}: {self.why}"


class Foreign(Unusable):
    """A sound checkpoint of another build (a directory builds share, or a recompiled build)."""


def verify(d: Path, fingerprint: str, num_workers: int) -> dict:
    """Raise Unusable naming the first bad file of checkpoint `d` (Foreign: it is another
    build's); returns its COMPLETE record. The directory's name, COMPLETE and every worker's
    metadata must agree on the step, build and lineage, and every file on its digest."""
    marker = d / MARKER
    try:
        step = int(d.name.split("_", 1)[1])
    except (IndexError, ValueError):
        raise Unusable(d, "not named step_N") from None
    record = _record(marker)
    if record is None:
        raise Unusable(marker, "unreadable COMPLETE record (not JSON, or not readable)")
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise Unusable(marker, "COMPLETE record of another format (written by an older h2x, "
                       "without the bindings and digests this one checks); it cannot be verified")
    if record.get("step") != step:
        raise Unusable(marker, f"COMPLETE records step {_short(record.get('step'))}, but the "
                       f"directory is named for step {step}: it was renamed or copied")
    if record.get("build") != fingerprint:
        raise Foreign(marker, f"belongs to a different build (build fingerprint "
                      f"{str(record.get('build'))[:12]}, this build's {fingerprint[:12]}): the "
                      "build was recompiled, the checkpoint copied in from elsewhere, or "
                      "another build shares this directory")
    files = record.get("files") if isinstance(record.get("files"), dict) else {}
    for wid in range(num_workers):
        for name in worker_files(wid):
            p = d / name
            want = files.get(name)
            if not isinstance(want, dict):
                raise Unusable(p, "not in the COMPLETE record")
            try:
                with open(p, "rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    if size != want.get("size"):
                        raise Unusable(p, f"truncated or extended: {size} bytes, "
                                       f"{_short(want.get('size'))} were written")
                    sha, _ = _digest(f)
            except OSError as e:
                raise Unusable(p, f"cannot read it ({e.strerror})") from None
            if sha != want.get("sha256"):
                raise Unusable(p, "corrupt: its sha256 differs from the one recorded when it "
                               "was written")
        mf = d / worker_files(wid)[1]
        try:
            meta = _read_meta(mf)
        except Exception as e:          # OSError, or msgpack's own error types
            raise Unusable(mf, f"unreadable metadata ({type(e).__name__})") from None
        for key, want in (("step", step), ("build", fingerprint),
                          ("lineage", record.get("lineage")), ("worker", wid)):
            if meta.get(key) != want:
                raise Unusable(mf, f"records {key} {_short(meta.get(key))} where COMPLETE has "
                               f"{_short(want)}: these files are not of this checkpoint")
    return record


def resume_point(root: Path, fingerprint: str, num_workers: int, out) -> tuple[int, Path]:
    """The newest checkpoint of this build that verifies; each newer one that does not (another
    build's included) is named in a note. No usable one at all is an H2Error listing why each
    was refused."""
    root = Path(root)
    refused = []
    for s, d in (_steps(root) if root.is_dir() else []):
        if not d.is_dir():
            out(f"note: {d} is not a directory; skipped")
            continue
        if not (d / MARKER).is_file():
            try:
                written = any(d.iterdir())
            except OSError:
                written = True
            if written:
                out(f"note: {d} has no {MARKER} marker (a run stopped while writing it); skipped")
            continue
        try:
            verify(d, fingerprint, num_workers)
        except Unusable as e:
            out(f"note: checkpoint {d.name} is not usable: {e}; trying the previous one")
            refused.append(f"{d.name}: {e}")
            continue
        return s, d
    if refused:
        raise H2Error("--resume: no usable checkpoint:\n  " + "\n  ".join(refused), str(root),
                      hint="resume needs a checkpoint written by this build; move "
                      f"{root} away (or give --checkpoint-dir another) to start from step 0")
    raise H2Error("--resume: no complete checkpoint to resume from", str(root))


def remove_partial_writes(root: Path) -> list[Path]:
    """Remove what killed writers left in the step directories: our `NAME.tmp` files and
    safetensors' own `.tmpXXXXXX` inside them. Call it only while holding the checkpoint
    directory's lock (executor/rundir.py RunLock): a running writer's files are not partial."""
    root = Path(root)
    removed = []
    for _, d in (_steps(root) if root.is_dir() else []):
        if not d.is_dir() or d.is_symlink():
            continue
        for f in d.iterdir():
            if not (f.name.endswith(".tmp") or _SAFETENSORS_TMP.fullmatch(f.name)):
                continue
            if f.is_file() and not f.is_symlink():
                try:
                    f.unlink()
                except OSError:         # not ours to remove (permissions): left as it is
                    continue
                removed.append(f)
    return removed
