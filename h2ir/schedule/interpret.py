"""The stream interpreter: one method per instruction kind, as torch.fx.Interpreter has one per
opcode. The executor's worker (`executor/worker.py`) and the simulator
(`h2ir/planner/simulate.py`) are its two subclasses; they differ only in what executing one
instruction means — running kernels and DiComm transfers, or advancing clocks by the resource
model's durations.
"""
from __future__ import annotations

from h2ir.schedule.streams import OPS, Instr


class StreamInterpreter:
    """Interprets one worker's instruction stream. A concrete subclass defines every kind in
    `OPS`; one that forgets a kind fails when it is instantiated, not at step 500."""

    def __init__(self, wid: int, stream: list[Instr]):
        missing = [op for op in OPS if getattr(type(self), op) is getattr(StreamInterpreter, op)]
        if missing:
            raise TypeError(f"{type(self).__name__} does not interpret: {', '.join(missing)}")
        self.wid = wid
        self.stream = stream
        self.pc = 0                      # index of the next instruction

    def run_instr(self, ins: Instr):
        return getattr(self, ins.op)(ins)

    def run_stream(self):
        """Run the whole stream from the start (one training step); `before_instr` sees each."""
        for self.pc, ins in enumerate(self.stream):
            self.before_instr(self.pc, ins)
            self.run_instr(ins)
            self.after_instr(self.pc, ins)
        self.pc = len(self.stream)

    def before_instr(self, pc: int, ins: Instr) -> None:
        pass

    def after_instr(self, pc: int, ins: Instr) -> None:
        pass

    # -- one method per instruction kind ------------------------------------------------------
    def fwd(self, ins: Instr): raise NotImplementedError
    def bwd(self, ins: Instr): raise NotImplementedError
    def bwd_input(self, ins: Instr): raise NotImplementedError
    def bwd_weight(self, ins: Instr): raise NotImplementedError
    def send_act(self, ins: Instr): raise NotImplementedError
    def recv_act(self, ins: Instr): raise NotImplementedError
    def send_grad(self, ins: Instr): raise NotImplementedError
    def recv_grad(self, ins: Instr): raise NotImplementedError
    def all_reduce(self, ins: Instr): raise NotImplementedError
    def all_to_all(self, ins: Instr): raise NotImplementedError
    def opt_step(self, ins: Instr): raise NotImplementedError
    def migrate(self, ins: Instr): raise NotImplementedError
    def send_tied_grads(self, ins: Instr): raise NotImplementedError
    def recv_tied_grads(self, ins: Instr): raise NotImplementedError
    def send_tied_params(self, ins: Instr): raise NotImplementedError
    def recv_tied_params(self, ins: Instr): raise NotImplementedError
    def reduce_scatter(self, ins: Instr): raise NotImplementedError
    def all_gather(self, ins: Instr): raise NotImplementedError
