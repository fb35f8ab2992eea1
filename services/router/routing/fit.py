"""The fits behind the service-time estimate (``estimate.py``): least squares over reports that
fade, held to a prior; a worker's speed against its pool's fit, shrunk to 1 by its own
doubt; the queue's factor. Pure arithmetic on plain numbers."""

from __future__ import annotations

from dataclasses import dataclass

POOL_FORGET = 0.995  # a report's weight after each later one: a pool's fit, which hears all...
WORKER_FORGET = 0.95  # ...and a worker's speed
PRIOR_WEIGHT = 2.0  # the prior counts as this many typical reports...
Z_FLOOR = 0.1  # ...a term's typical share of a report's time taken as at least this
SPEED_PRIOR = 1.0  # a worker's speed starts as this many reports' worth of its pool's...
SPEED_SIGMAS = 3.0  # ...and stays its pool's until this many standard errors from it
QUEUE_FACTOR = (0.5, 2.0)  # the wait's factor stays within these


class Speed:
    """A worker's compute and load times as multiples of its pool's fit: the (c, l)
    minimizing Σ forgetᵃᵍᵉ (c·z_c + l·z_l − 1)² + ``SPEED_PRIOR``·((c − 1)² + (l − 1)²), where a
    report's z are the pool's compute and load terms ÷ its measured time; then each shrunk to
    1 by its own standard error s (positive-part James–Stein at ``SPEED_SIGMAS`` = k: d = c − 1
    becomes d·max(0, 1 − k²s²/d²)), so chance differences between workers alike, and the
    reports' own quirks (a request batched with others reports the whole pass), are not taken
    for speed."""

    __slots__ = ("cc", "cl", "ll", "c1", "l1", "one", "n", "factors")

    def __init__(self) -> None:
        self.cc = self.cl = self.ll = self.c1 = self.l1 = self.one = self.n = 0.0
        self.factors = (1.0, 1.0)

    def add(self, zc: float, zl: float) -> None:
        g = WORKER_FORGET
        self.cc = g * self.cc + zc * zc
        self.cl = g * self.cl + zc * zl
        self.ll = g * self.ll + zl * zl
        self.c1 = g * self.c1 + zc
        self.l1 = g * self.l1 + zl
        self.one = g * self.one + 1.0
        self.n = g * self.n + 1.0
        self.factors = self._solve()

    def _solve(self) -> tuple[float, float]:
        k = SPEED_PRIOR
        a, b, d = self.cc + k, self.cl, self.ll + k
        det = a * d - b * b
        rc, rl = self.c1 + k, self.l1 + k
        compute = (d * rc - b * rl) / det
        load = (a * rl - b * rc) / det
        # residual variance per report, and each factor's variance from the inverse's diagonal
        sse = self.one - 2 * (compute * self.c1 + load * self.l1)
        sse += compute * compute * self.cc + 2 * compute * load * self.cl + load * load * self.ll
        var = max(0.0, sse) / max(1.0, self.n - 2)
        return _shrunk(compute, var * d / det), _shrunk(load, var * a / det)


def _shrunk(x: float, variance: float) -> float:
    d = x - 1.0
    doubt = SPEED_SIGMAS**2 * variance
    if d * d <= doubt:
        return 1.0
    return max(0.05, 1.0 + d * (1.0 - doubt / (d * d)))


class LeastSquares:
    """Least squares over reports that fade, held to a prior, no coefficient below 0: the β
    minimizing Σ forgetᵃᵍᵉ (β·z − 1)² + Σₖ λₖ (βₖ − priorₖ)², where a report's z is its terms
    ÷ its measured time (relative error) and λₖ is ``PRIOR_WEIGHT`` typical reports' worth of
    term k, its typical share taken as at least ``Z_FLOOR`` (a term no report has shown stays
    at its prior)."""

    def __init__(self, n: int, forget: float, prior_weight: float = PRIOR_WEIGHT) -> None:
        self.n = n  # terms
        self.forget = forget
        self.prior_weight = prior_weight  # (of the prior)
        self.zz = [[0.0] * n for _ in range(n)]
        self.z1 = [0.0] * n
        self.weight = 0.0  # of all reports, faded
        self.reports = 0
        self.unsolved = 0  # reports added since the last solve

    def add(self, terms: tuple[float, ...], measured_s: float) -> None:
        g = self.forget
        z = [t / measured_s for t in terms]
        self.weight = g * self.weight + 1.0
        self.reports += 1
        self.unsolved += 1
        self.z1 = [g * a + zi for a, zi in zip(self.z1, z, strict=True)]
        self.zz = [
            [g * a + zi * zj for a, zj in zip(row, z, strict=True)] if zi else [g * a for a in row]
            for row, zi in zip(self.zz, z, strict=True)
        ]

    def solve(self, prior: list[float] | tuple[float, ...]) -> list[float]:
        self.unsolved = 0
        return self._solve(prior)

    def _solve(self, prior: list[float] | tuple[float, ...]) -> list[float]:
        # (a term that has been a sliver of every report's time is held as one a tenth of
        # it: its β is not for the reports to invent, and a longer prompt would multiply it)
        n = max(self.weight, 1.0)
        ridge = [self.prior_weight * max(self.zz[k][k] / n, Z_FLOOR**2) for k in range(self.n)]
        free = set(range(self.n))
        while True:
            a = [
                [self.zz[i][j] if i in free and j in free else 0.0 for j in range(self.n)]
                for i in range(self.n)
            ]
            b = [self.z1[i] + ridge[i] * prior[i] if i in free else 0.0 for i in range(self.n)]
            for k in range(self.n):
                a[k][k] += ridge[k] if k in free else 1.0
            beta = solve_linear(a, b)
            negative = {k for k in free if beta[k] < 0}
            if not negative:
                return beta
            free -= negative  # held at 0, the rest solved again


def solve_linear(a: list[list[float]], b: list[float]) -> list[float]:
    """x with a·x = b, by Gaussian elimination with partial pivoting (a is small and, with the
    ridge, positive definite)."""
    n = len(b)
    m = [[*row, b[i]] for i, row in enumerate(a)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        m[c], m[p] = m[p], m[c]
        top = m[c]
        for r in range(c + 1, n):
            f = m[r][c] / top[c]
            if f:
                row = m[r]
                for k in range(c, n + 1):
                    row[k] -= f * top[k]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][k] * x[k] for k in range(r + 1, n))) / m[r][r]
    return x


@dataclass(slots=True)
class Factor:
    """waited ≈ factor × ahead: the waits' sum over the estimates' (a short wait estimated
    from a sliver of work says little: ratios of sums, not sums of ratios), over reports that
    fade, held to 1 by ``PRIOR_WEIGHT`` typical reports, within ``QUEUE_FACTOR``."""

    waited: float = 0.0
    ahead: float = 0.0
    weight: float = 0.0
    value: float = 1.0

    def add(self, ahead_s: float, waited_s: float) -> None:
        if ahead_s <= 0 and waited_s <= 0:
            return
        g = POOL_FORGET
        self.waited = g * self.waited + waited_s
        self.ahead = g * self.ahead + ahead_s
        self.weight = g * self.weight + 1.0
        prior = PRIOR_WEIGHT * self.ahead / self.weight
        lo, hi = QUEUE_FACTOR
        if self.ahead + prior > 0:
            self.value = min(hi, max(lo, (self.waited + prior) / (self.ahead + prior)))
