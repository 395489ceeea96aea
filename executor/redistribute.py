"""Boundary tensors between stages of different tensor-parallel degrees (H2, arXiv 2505.17548:
NIC-affinity redistribution), and the TP group's collectives of a stage program.

A TP stage's boundary activations (and the gradients of its inputs) are replicated across its
ranks: the row-parallel all-reduce (or f's backward all-reduce) leaves every rank with the whole
tensor. So no rank has to gather: when a stage of degree a sends to one of degree b, sender i
transmits share i of a slices (along `share_dim`) to every receiver, and a receiver
concatenates the a shares. Every sender's link carries 1/a of the bytes, instead of one rank's
link carrying all of them (Narayanan et al. SC'21 Sec. 4.1 scatter/gather, across degrees).

The stream instructions say who sends which share (h2ir/schedule/streams.py); these functions
do the transfers over any object with DiComm's send/recv/all_reduce/all_to_all.
"""
from __future__ import annotations

import numpy as np

from h2ir.schedule.streams import Instr, share_dim


def share_of(arr: np.ndarray, index: int, count: int) -> np.ndarray:
    """Share `index` of `count` of a boundary tensor (np.array_split along share_dim)."""
    if count == 1:
        return arr
    return np.ascontiguousarray(np.array_split(arr, count, axis=share_dim(arr.shape))[index])


def send_shares(comm, arr: np.ndarray, ins: Instr, kind: str, stage: int) -> int:
    """Send this worker's share of `arr` to every peer of `ins`; returns the bytes sent."""
    index, count = ins.share or (0, 1)
    part = share_of(np.asarray(arr), index, count)
    for peer in ins.peers:
        comm.send(peer, part, kind=kind, mb=ins.mb, stage=stage)
    return part.nbytes * len(ins.peers)


def recv_shares(comm, ins: Instr, kind: str, shape: tuple) -> np.ndarray:
    """The whole tensor from the shares of every peer of `ins` (one peer: its tensor)."""
    parts = [comm.recv(peer, kind=kind, mb=ins.mb) for peer in ins.peers]
    if len(parts) == 1:
        return parts[0]
    return np.concatenate(parts, axis=share_dim(shape))


class TPGroupComm:
    """The comm hook of a TP stage's programs (backends/base.py run_program): the program's
    `tp_all_reduce` / `tp_rank` ops over this worker's TP group. Sums go through DiComm's ring
    all-reduce (every rank ends with the same bits); the max (the vocabulary-parallel softmax's
    small [tokens, 1] stabiliser) is gathered with DiComm's all-to-all and taken locally."""

    def __init__(self, comm_of, be, group: list[int], rank: int):
        self.comm_of, self.be, self.group, self.rank = comm_of, be, list(group), rank
        self.bytes = 0                  # payload bytes this rank contributed to collectives

    def __call__(self, op: str, *inputs, size: int, reduce: str = "sum"):
        from h2ir.types import dtype_of_host
        be = self.be
        if size != len(self.group):
            raise RuntimeError(f"program op {op} expects a TP group of {size}, this worker's "
                               f"has {len(self.group)}")
        if op == "tp_rank":
            return be.from_numpy(np.array(self.rank, dtype=np.int64), "i64")
        if op != "tp_all_reduce":
            raise RuntimeError(f"no TP collective for op {op}")
        a = np.array(be.to_numpy(inputs[0]), copy=True, order="C")
        self.bytes += a.nbytes
        comm = self.comm_of()
        if reduce == "sum":
            comm.all_reduce([a], group=self.group, op="sum")
        elif reduce == "max":
            a = np.maximum.reduce(comm.all_to_all([a] * len(self.group), group=self.group))
        else:
            raise RuntimeError(f"tp_all_reduce reduce={reduce!r}")
        return be.from_numpy(np.ascontiguousarray(a), dtype_of_host(a.dtype))
