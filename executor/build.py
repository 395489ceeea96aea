"""Reading a build directory (the compiler's artifact). h2x needs only this and the backends."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from h2ir.errors import H2Error, read_user_file
from h2ir.schedule.streams import parse_stream
from h2ir.text import load_graph

SUPPORTED_FORMATS = ("h2-build/1",)


@dataclass
class StageArtifacts:
    index: int
    backend: str
    device: str | None
    dtype_policy: str
    fwd: object             # h2ir Graph
    bwd: object
    sig: dict               # stageN.json (frontend.stages.StageProgram.meta)
    weights: Path | None
    consts: Path | None


class BuildDir:
    def __init__(self, path: str):
        self.path = Path(path)
        mf = self.path / "manifest.json"
        if not mf.is_file():
            raise H2Error("not a build directory (no manifest.json); run `h2c compile` first",
                          str(self.path))
        try:
            self.manifest = json.loads(mf.read_text())
        except json.JSONDecodeError as e:
            raise H2Error(f"manifest is not valid JSON: {e.msg}", str(mf), e.lineno, e.colno) from None
        if self.manifest.get("format") not in SUPPORTED_FORMATS:
            raise H2Error(f"build format {self.manifest.get('format')!r} is not supported (expected "
                          f"{', '.join(SUPPORTED_FORMATS)})", str(mf))
        if self.manifest.get("dry_run"):
            raise H2Error("this build was compiled with --dry-run (no weights); it cannot be run",
                          str(mf))

    @property
    def num_stages(self) -> int:
        return len(self.manifest["stages"])

    @property
    def workers(self) -> list[dict]:
        return self.manifest["workers"]

    def stage(self, s: int) -> StageArtifacts:
        st = self.manifest["stages"][s]
        sig = json.loads((self.path / st["signature"]).read_text())
        return StageArtifacts(
            index=s, backend=st["backend"], device=st.get("device"), dtype_policy=st.get("dtype_policy", "fp32"),
            fwd=load_graph(str(self.path / st["fwd"])), bwd=load_graph(str(self.path / st["bwd"])),
            sig=sig, weights=self.path / st["weights"], consts=self.path / st["consts"])

    def stream(self, worker: int):
        w = self.workers[worker]
        p = self.path / w["stream"]
        return parse_stream(read_user_file(p, "instruction stream"), file=str(p))

    def model_costs(self):
        g = load_graph(str(self.path / "model.h2ir"))
        return g.layer_costs()
