"""The lines of stages of one configuration: each chip type's stage sequences, every line of a
small space (`lines_exact`) and coordinate descent over a large one (`LocalLines`)."""
from __future__ import annotations

import itertools
import math

from h2ir.planner.search.space import PlanSpace


def type_sequences(B: int, tps: list[int], L: int, space: PlanSpace, exact: bool) -> list[tuple]:
    """The tp sequences of one chip type's stages with B chips per replica: one tp for all its
    stages (B // tp of them), or, with `mixed_tp`, h stages at one tp t1 followed by the rest at
    another t2: a higher one first (earlier stages hold more micro-batches in flight) or a
    lower one first (a first stage that holds only the embedding needs no TP; `lower_first`).
    With `idle` and `partial`, a type may also be used in part: fewer stages than its chips
    allow, the rest idle (a slow chip with room for the embedding is worth one stage, not
    one stage per chip, each of which must then hold a layer); without it every chip is used.
    At most L stages (each needs a layer). In `exact` mode every count of stages is offered;
    outside it, h takes a quarter, a half and three quarters of the range, and a uniform
    sequence its full length, 1, 2 and a quarter, a half and three quarters of it."""
    out = _one_tp_sequences(B, tps, L, space, exact)
    if space.mixed_tp:
        for i, t1 in enumerate(tps):
            others = tps[:i] + (tps[i + 1:] if space.lower_first else []) if exact else \
                tps[max(0, i - 1):i] + (tps[i + 1:i + 2] if space.lower_first else [])
            for t2 in others:
                out += _two_tp_sequences(B, t1, t2, L, space, exact)
    return list(dict.fromkeys(out))


def _one_tp_sequences(B: int, tps: list[int], L: int, space: PlanSpace, exact: bool) -> list:
    """`type_sequences` at one tp: every chip used (at most L stages), or with `partial` fewer
    stages, the rest idle."""
    out = []
    for t in tps:
        s = B // t
        if s == 0 or (not space.idle and B % t):
            continue
        if s > L:
            if not space.idle:
                continue
            s = L
        out.append((t,) * s)
        if space.idle and space.partial:     # the type in part: k < s stages, the rest idle
            ks = range(1, s) if exact else {1, 2, s // 4, s // 2, 3 * s // 4}
            out += [(t,) * k for k in sorted(ks) if 1 <= k < s]
    return out


def _two_tp_sequences(B: int, t1: int, t2: int, L: int, space: PlanSpace, exact: bool) -> list:
    """`type_sequences` of h stages at t1 followed by the rest at t2."""
    out = []
    partial = space.idle and space.partial
    hmax = (B - t2) // t1
    # at most L stages: h beyond L can never give a line (and B may be 10^9 chips)
    hs = range(1, min(hmax, L) + 1) if exact else sorted({max(1, hmax * q // 4) for q in (1, 2, 3)})
    for h in hs:
        if h > hmax or h > L:
            continue
        rest = B - h * t1
        if not space.idle and rest % t2:
            continue
        if h + rest // t2 > L and not partial:
            continue
        r = min(rest // t2, L - h)
        # in exact mode with `partial`, every shorter tail too (the rest idle)
        for k in (range(1, r + 1) if exact and partial else (r,)):
            if k >= 1:
                out.append((t1,) * h + (t2,) * k)
    return out


def sequences_at_most(B: int, tps: list[int], L: int) -> int:
    """An upper bound of len(type_sequences(B, tps, L, space, exact=True)) for any space,
    without building them: k stages of one tp, or h of one and k of another (h + k <= L)."""
    n = sum(min(B // t, L) for t in tps)
    for t1 in tps:
        for t2 in tps:
            if t1 != t2:
                h = min((B - t2) // t1, L) if B >= t1 + t2 else 0
                n += h * min(B // t2, L)
    return n


def lines_exact(seqs: dict, space: PlanSpace, L: int, limit: int):
    """Every line of the space for one configuration, or None if there are more than `limit`:
    each used type one of its sequences (`type_sequences`; with `idle`, a type may be absent),
    in any order of the types' blocks; with `split_types`, one type's sequence may be cut into
    two blocks anywhere in the order (its first part first)."""
    chips = sorted(seqs)
    choices = [seqs[c] + ([None] if space.idle else []) for c in chips]
    if math.prod(len(c) for c in choices) > 20 * limit:
        return None
    out: dict = {}
    for pick in itertools.product(*choices):
        used = [(c, s) for c, s in zip(chips, pick) if s is not None]
        if not used or sum(len(s) for _, s in used) > L:
            continue
        for blocks in _blocksets(used, space.split_types):
            for shapes in _block_orders(blocks):
                out[shapes] = None
                if len(out) > limit:
                    return None
    return list(out)


def _blocksets(used: list, split_types: bool) -> list:
    """The blocks of one pick of sequences: a block per type, and with `split_types` also each
    way of cutting one type's sequence in two (its second part named with a trailing NUL)."""
    blocksets = [list(used)]
    if split_types:
        for i, (c, s) in enumerate(used):
            for cut in range(1, len(s)):
                blocksets.append([x for k, x in enumerate(used) if k != i]
                                 + [(c, s[:cut]), (c + "\0", s[cut:])])
    return blocksets


def _block_orders(blocks: list):
    """The lines of every order of `blocks` that keeps a cut type's first part first."""
    for perm in itertools.permutations(blocks):
        names = [c for c, _ in perm]
        if any(c.endswith("\0") and names.index(c) < names.index(c[:-1]) for c in names):
            continue
        yield tuple((c.rstrip("\0"), t) for c, s in perm for t in s)


class LocalLines:
    """Lines for a configuration too large to enumerate: coordinate descent over each type's
    stage sequence (one of `type_sequences`, or idle), moves of one block to another place in
    the order, and cutting one type into two blocks (A-B-A); each line scored by the bound of
    its bottleneck-packed split. O(types x sequences + blocks^2) lines per round, not k!."""

    ROUNDS = 3

    def __init__(self, score, seqs: dict, first_order: list, space: PlanSpace, L: int):
        self.score, self.seqs, self.space, self.L = score, seqs, space, L
        self.first_order = first_order
        self.seen: dict = {}
        self.rounds = self.ROUNDS

    def shapes(self, pick: dict, order: list, cut) -> tuple:
        out = []
        for c, part in order:
            s = pick[c]
            if cut is not None and cut[0] == c:
                s = s[:cut[1]] if part == 0 else s[cut[1]:]
            out += [(c, t) for t in s]
        return tuple(out)

    def value(self, pick, order, cut) -> float:
        sh = self.shapes(pick, order, cut)
        if not sh or len(sh) > self.L:
            return math.inf
        if sh not in self.seen:
            self.seen[sh] = self.score(sh)
        return self.seen[sh]

    def initial(self) -> tuple:
        """The line the descent starts from: each type's highest-tp, shortest sequence, the
        types in `first_order`, none cut."""
        pick = {c: max(self.seqs[c], key=lambda s: (s[0], -len(s))) for c in self.seqs}
        return pick, [(c, 0) for c in self.first_order], None

    def usable(self, start) -> bool:
        """Whether a state (pick, order, cut) of a related configuration is one of this one's."""
        return start is not None and all(c in self.seqs and s in self.seqs[c]
                                         for c, s in start[0].items())

    def start_value(self, start=None) -> float:
        """The score of the line the descent would start from."""
        v = self.value(*self.initial())
        if self.usable(start):
            v = min(v, self.value(*start))
        return v

    def run(self, keep: int = 3, start=None) -> list:
        """The `keep` best lines as (score, shapes); `start` (pick, order, cut) from a related
        configuration (the same dp) seeds the descent, which then needs fewer rounds."""
        state = self.initial()
        best = self.value(*state)
        if self.usable(start):
            v = self.value(*start)
            if v < best:
                best, state = v, start
        for _ in range(self.rounds):
            moves = self.moves(*state)
            scored = [(self.value(p, o, c), i) for i, (p, o, c) in enumerate(moves)]
            if not scored:
                break
            v, i = min(scored)
            if v >= best:
                break
            best, state = v, moves[i]
        self.state = state
        ranked = sorted((v, sh) for sh, v in self.seen.items() if v < math.inf)
        return ranked[:keep]

    def moves(self, pick: dict, order: list, cut) -> list:
        """Every neighbour of a state, in the order the descent scores them (ties: the first)."""
        return (self.sequence_moves(pick, order, cut) + self.order_moves(pick, order, cut)
                + self.cut_moves(pick, order, cut))

    def sequence_moves(self, pick: dict, order: list, cut) -> list:
        """Each type's stage sequence replaced by another of its own, or the type left idle."""
        moves = []
        for c in self.seqs:
            opts = list(self.seqs[c]) + ([None] if self.space.idle else [])
            for s in opts:
                if s != pick.get(c):
                    moves.append(self._with_sequence(pick, order, cut, c, s))
        return moves

    @staticmethod
    def _with_sequence(pick: dict, order: list, cut, c: str, s) -> tuple:
        p2, o2, c2 = dict(pick), list(order), cut
        if s is None:
            p2.pop(c, None)
            o2 = [b for b in o2 if b[0] != c]
            c2 = None if cut and cut[0] == c else cut
            return p2, o2, c2
        p2[c] = s
        if c not in pick:
            o2 = o2 + [(c, 0)]
        if cut and cut[0] == c:
            c2 = (c, min(cut[1], len(s) - 1)) if len(s) > 1 else None
            if c2 is None:
                o2 = [b for b in o2 if b != (c, 1)]
        return p2, o2, c2

    @staticmethod
    def order_moves(pick: dict, order: list, cut) -> list:
        """One block moved elsewhere in the order."""
        moves = []
        for i, blk in enumerate(order):
            rest = order[:i] + order[i + 1:]
            for k in range(len(rest) + 1):
                o2 = rest[:k] + [blk] + rest[k:]
                if o2 != order and _cut_order_ok(o2):
                    moves.append((pick, o2, cut))
        return moves

    def cut_moves(self, pick: dict, order: list, cut) -> list:
        """A-B-A: one type cut in two blocks (when none is yet), the second part anywhere after
        the first."""
        if not self.space.split_types or cut is not None:
            return []
        moves = []
        for c, s in pick.items():
            if len(s) < 2:
                continue
            for at in sorted({1, len(s) // 2}):
                for k in range(len(order) + 1):
                    o2 = order[:k] + [(c, 1)] + order[k:]
                    if _cut_order_ok(o2):
                        moves.append((pick, o2, (c, at)))
        return moves


def _cut_order_ok(order: list) -> bool:
    pos = {b: i for i, b in enumerate(order)}
    return all(pos[(c, 0)] < i for (c, part), i in pos.items() if part == 1 and (c, 0) in pos)
