"""Divisors of a count: the degrees (dp, tp, ep) the search offers and the validator checks."""
from __future__ import annotations


def divisors(n: int) -> list[int]:
    """The divisors of n, ascending, from its prime factors: O(sqrt n) trial division at worst
    (a 10^12-chip count: 10^6 steps), not a scan of 1..n."""
    divs = [1]
    for p, k in prime_factors(n).items():
        divs = [d * p ** e for d in divs for e in range(k + 1)]
    return sorted(divs)


def prime_factors(n: int) -> dict[int, int]:
    """{prime: multiplicity} of n."""
    out: dict[int, int] = {}
    p = 2
    while p * p <= n:
        while n % p == 0:
            out[p] = out.get(p, 0) + 1
            n //= p
        p += 1 if p == 2 else 2
    if n > 1:
        out[n] = out.get(n, 0) + 1
    return out
