"""How long a prefill worker takes over a request: the service-time half of the TTFT model,
learned from what the workers report.

Two estimates. ``Rates``, the plain one (Mooncake's Conductor keeps it): uncached tokens at a
compute rate, stored tokens at a load rate, memory-tier hits free; each rate a moving average
of what the worker reports. ``Fitted`` (the ``ttft`` policy's) fits the terms real engines
show, online, over the whole pool:

    service ≈ β₀·pass + β₁·uncached + β₂·uncached × (context + uncached / 2)
              + β₃·loaded + β₄·loaded × (share of the pool loading at once) + β₅·memory
              + β₆·passes × decoding sequences + β₇·passes × their context

each term in seconds at the configured rates (``Shape.terms``), so β₁ = β₃ = 1 and the rest 0
is the plain estimate, the prior: a pool that behaves as configured keeps it. The third term
is attention (each new token reads the context before it), the fifth the storage tier's
bandwidth shared by the loads running at once, the sixth a memory-tier hit's copy into the
engine, the last two the answers a worker that also decodes (vLLM, SGLang, the torch engine's
prefill on decode) runs in the same steps as each pass of the prompt: they slow it by their
number and by the KV they read. Least squares on relative error (a request's miss counts as a
share of its time, as the estimate's error is reported), recent reports weighing more, held to
the prior (``PRIOR_WEIGHT``), no term below 0.

A worker is its pool's fit times its own speed, compute and loads apart (``Speed``): two
factors fitted to its own reports, each shrunk to 1 by how sure they are (positive-part
James–Stein: a factor within its own noise of 1 is 1). Workers alike are ranked alike, not by
the luck of their last reports (a worker a few percent "faster" by chance would draw work
until its queue says otherwise); a worker truly slower, or one whose speed changed, is its own
within a few dozen reports. A worker not heard from yet is its measured peers' mean speed.

The queue's wait is learned too, one factor per pool: what requests waited against the work
the router counted ahead of them (a worker's batches and other routers' requests make them
differ). Every estimate keeps its error, |estimated − measured TTFT| ÷ measured, over all its
requests and recently (``/metrics``, the routing explanation, `kvmesh sim`'s summary).

Fitting happens when a worker reports (one 8 × 8 solve for the pool, a 2 × 2 for the
worker); ranking only adds up terms.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.router.routing.fit import POOL_FORGET, Factor, LeastSquares, Speed

TERMS = (
    "pass",
    "uncached",
    "attention",
    "loaded",
    "loaded_shared",
    "memory",
    "decoding",
    "decoding_context",
)
N = len(TERMS)
PRIOR = (0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0)  # the plain estimate
PASS_S = 0.001  # the pass term's unit (seconds), and a decoding sequence's in each pass
ATTENTION_CONTEXT = 8192  # the attention term's unit: β₂ = 1 doubles a token's cost there
RECENT = 0.05  # a request's weight in the recent error
KNOWN_MAX = 4096  # shapes whose parts a pool keeps between two fits
SOLVE_EVERY = 4  # a pool's fit is solved again after this many reports (each, at first)...
SOLVE_LATER = 16  # ...and past SOLVE_EVERY³ reports, after this many (~8% of its ~200's window)
FLOOR_S = 0.001  # a TTFT below this counts as this in the error (nothing measures finer)


@dataclass(slots=True)
class Shape:
    """A request on a worker, as the estimate sees it (tokens)."""

    uncached: int
    loaded: int = 0  # from the storage tier
    memory: int = 0  # in the worker's memory tier (or brought there by requests ahead)
    sharing: float = 0.0  # share of the pool loading from the storage tier meanwhile
    decoding: int = 0  # sequences the worker decodes meanwhile (a worker that also decodes)
    decoding_tokens: int = 0  # their context
    chunk: int = 0  # uncached tokens a pass takes (0: the prompt in one pass)

    @property
    def passes(self) -> int:
        u = max(1, self.uncached)
        return -(-u // self.chunk) if self.chunk else 1

    def terms(self, prefill_tok_s: float, load_tok_s: float) -> tuple[float, ...]:
        """Each term in seconds at these rates (the β's units)."""
        u = self.uncached
        passes = self.passes if self.decoding else 0
        return (
            PASS_S if u else 0.0,
            u / prefill_tok_s,
            u * (self.loaded + self.memory + u / 2) / prefill_tok_s / ATTENTION_CONTEXT,
            self.loaded / load_tok_s,
            self.loaded * self.sharing / load_tok_s,
            self.memory / load_tok_s,
            passes * self.decoding * PASS_S,
            passes * self.decoding_tokens / load_tok_s,
        )


@dataclass(slots=True)
class Error:
    """How far estimates were from what came, as a share of what came (at least
    ``FLOOR_S``): over every request (the mean: MAPE) and recently (an exponential average)."""

    n: int = 0
    total: float = 0.0
    recent: float = 0.0

    def add(self, estimated_s: float, measured_s: float) -> None:
        e = abs(estimated_s - measured_s) / max(measured_s, FLOOR_S)
        self.n += 1
        self.total += e
        self.recent = e if self.n == 1 else self.recent + RECENT * (e - self.recent)

    @property
    def mape(self) -> float:
        return self.total / self.n if self.n else 0.0


@dataclass(slots=True)
class Ewma:
    """An exponentially weighted moving average, starting from a prior."""

    value: float
    weight: float = 0.2  # of each new observation
    observed: int = 0

    def observe(self, x: float) -> None:
        if x > 0:
            self.value += self.weight * (x - self.value)
            self.observed += 1


class Rates:
    """The plain estimate: a compute rate and a load rate, each a moving average of reports.
    A pool's (``pool=None``) holds its workers' mean rates, set by ``RoutingPolicy``."""

    def __init__(self, prefill_tok_s: float, load_tok_s: float, pool: Rates | None = None):
        self.prefill_tok_s = Ewma(prefill_tok_s)
        self.load_tok_s = Ewma(load_tok_s)
        self.pool = pool
        self.error = Error()

    @property
    def alike(self) -> object:
        """Estimates with the same ``alike`` give the same parts for the same request."""
        return self

    @property
    def tok_s(self) -> float:
        """Uncached tokens a second (what a worker's reported queue takes)."""
        return self.prefill_tok_s.value

    def parts(self, r: Shape) -> tuple[float, float]:
        """The request's compute and load times here."""
        return r.uncached / self.prefill_tok_s.value, r.loaded / self.load_tok_s.value

    def compute_s(self, r: Shape) -> float:
        return self.parts(r)[0]

    def load_s(self, r: Shape) -> float:
        return self.parts(r)[1]

    def service_s(self, r: Shape) -> float:
        compute, load = self.parts(r)
        return compute + load

    def pass_s(self, r: Shape) -> float:
        """What one pass costs whatever it computes (a request that joins a pass queued there
        does not pay it again)."""
        return 0.0

    def wait_s(self, ahead_s: float) -> float:
        """How long a request waits behind ``ahead_s`` of estimated work."""
        return ahead_s

    def observe(
        self,
        r: Shape,
        prefill_s: float,
        load_s: float,
        others: tuple[Shape, ...] | None = (),
    ) -> None:
        """A worker's report: ``prefill_s`` computing (everything, when it does not tell its
        loads apart), ``load_s`` loading; ``others``: the requests it was computed with in one
        pass (None: a pass whose report was learned already). The report is the whole pass's:
        the plain estimate takes it as the request's own, as Mooncake's Conductor would."""
        if prefill_s > 0 and r.uncached:
            self.prefill_tok_s.observe(r.uncached / prefill_s)
        if load_s > 0 and r.loaded:
            self.load_tok_s.observe(r.loaded / load_s)

    def waited(self, ahead_s: float, waited_s: float) -> None:
        """A request waited ``waited_s`` behind ``ahead_s`` of estimated work."""

    def leave(self) -> None:
        """The worker left its pool."""

    def terms(self) -> dict[str, float]:
        return {"prefill_tok_s": self.prefill_tok_s.value, "load_tok_s": self.load_tok_s.value}


class Fitted(Rates):
    """The fitted estimate: a pool's (``pool=None``: the terms' fit), or a worker's (its
    pool's fit at its own ``Speed``)."""

    def __init__(self, prefill_tok_s: float, load_tok_s: float, pool: Fitted | None = None):
        super().__init__(prefill_tok_s, load_tok_s, pool)
        self.units = (prefill_tok_s, load_tok_s)  # fixed: the β's units
        self.fit = LeastSquares(N, POOL_FORGET) if pool is None else None
        self.own: list[float] | None = None  # (a pool's) β, once reports came
        self.known: dict[tuple, tuple[float, float]] = {}  # (a pool's) shape → its parts
        self.speed = Speed()  # (a worker's)
        self.queue = Factor()  # (the pool's is used)
        # (a pool's) its reporting workers' speeds, and their mean: what a worker not heard
        # from is taken to be, so it is tried as soon as the measured ones are
        self.members: dict[int, tuple[float, float]] = {}
        self.speed_sum = (0.0, 0.0)
        self.mean = (1.0, 1.0)

    @property
    def beta(self) -> list[float] | tuple[float, ...]:
        """The pool's terms (a worker's speed is apart: ``factors``)."""
        if self.pool is not None:
            return self.pool.beta
        return PRIOR if self.own is None else self.own

    @property
    def alike(self) -> object:
        return self.factors  # (a worker is its pool's fit at its speed)

    @property
    def factors(self) -> tuple[float, float]:
        """This worker's compute and load times against its pool's fit."""
        if self.pool is None:
            return (1.0, 1.0)
        return self.speed.factors if self.speed.n else self.pool.mean

    @property
    def tok_s(self) -> float:
        beta = self.beta
        per_token = beta[1] + beta[2] * 0.5 / ATTENTION_CONTEXT
        return self.units[0] / max(per_token * self.factors[0], 1e-9)

    def pool_parts(self, r: Shape | tuple[float, ...]) -> tuple[float, float]:
        """The pool fit's compute terms (pass, uncached, attention, the answers decoded
        meanwhile) and load terms, each summed; of a request, or of terms already made."""
        if self.pool is not None:
            return self.pool.pool_parts(r)
        if isinstance(r, tuple):
            return self._sum(r)
        # A decision asks the same of most workers (those that hold none of the prompt):
        # answers are kept until the fit changes.
        key = (r.uncached, r.loaded, r.memory, r.sharing, r.decoding, r.decoding_tokens, r.chunk)
        out = self.known.get(key)
        if out is None:
            if len(self.known) >= KNOWN_MAX:
                self.known.clear()
            out = self.known[key] = self._sum(r.terms(*self.units))
        return out

    def _sum(self, t: tuple[float, ...]) -> tuple[float, float]:
        beta = self.beta
        return (
            beta[0] * t[0] + beta[1] * t[1] + beta[2] * t[2] + beta[6] * t[6] + beta[7] * t[7],
            beta[3] * t[3] + beta[4] * t[4] + beta[5] * t[5],
        )

    def parts(self, r: Shape) -> tuple[float, float]:
        compute, load = self.pool_parts(r)
        if self.pool is None:
            return compute, load
        fc, fl = self.factors
        return compute * fc, load * fl

    def pass_s(self, r: Shape) -> float:
        beta, t = self.beta, r.terms(*self.units)
        if not t[0]:
            return 0.0
        each = beta[0] * t[0] + (beta[6] * t[6] + beta[7] * t[7]) / r.passes
        return each * self.factors[0]

    def wait_s(self, ahead_s: float) -> float:
        return ahead_s * (self.pool or self).queue.value

    def pass_terms(self, r: Shape, others: tuple[Shape, ...] = ()) -> tuple[float, ...]:
        """A pass's terms: ``r``'s, plus the tokens ``others`` computed in it."""
        terms = r.terms(*self.units)
        if not others:
            return terms
        out = list(terms)
        for o in others:
            t = o.terms(*self.units)
            out[1] += t[1]
            out[2] += t[2]
        return tuple(out)

    def observe(
        self,
        r: Shape,
        prefill_s: float,
        load_s: float,
        others: tuple[Shape, ...] | None = (),
    ) -> None:
        """A report, of a request's own pass or of one it shared with ``others``: the pass's
        terms are its own and the others' tokens computed (one pass, one set of answers
        stepped in it); a pass is learned once (``others`` None: it was)."""
        measured = prefill_s + load_s
        if measured <= 0 or others is None:
            return
        terms = self.pass_terms(r, others)
        pool = self.pool
        if pool is None:
            fit = self.fit
            assert fit is not None, "a pool's estimate fits"
            fit.add(terms, measured)
            # Each report moves a fit of hundreds by little: solved at each of the first
            # reports, then every SOLVE_LATER (a pool hears every worker's).
            if fit.reports <= SOLVE_EVERY**3 or fit.unsolved >= SOLVE_LATER:
                self.own = fit.solve(PRIOR)
                self.known.clear()
            return
        compute, load = pool.pool_parts(terms)  # (before the pool hears it: out of sample)
        pool.observe(r, prefill_s, load_s, others)
        self.speed.add(compute / measured, load / measured)
        pool._member(self, self.speed.factors)

    def leave(self) -> None:
        """The worker left its pool."""
        if self.pool is not None:
            self.pool._member(self, None)

    def _member(self, worker: Fitted, factors: tuple[float, float] | None) -> None:
        """(a pool's) a reporting worker's speed now (None: it left); the mean follows."""
        old = self.members.pop(id(worker), None)
        if old is not None:
            self.speed_sum = (self.speed_sum[0] - old[0], self.speed_sum[1] - old[1])
        if factors is not None:
            self.members[id(worker)] = factors
            self.speed_sum = (self.speed_sum[0] + factors[0], self.speed_sum[1] + factors[1])
        n = len(self.members)
        self.mean = (self.speed_sum[0] / n, self.speed_sum[1] / n) if n else (1.0, 1.0)

    def waited(self, ahead_s: float, waited_s: float) -> None:
        (self.pool or self).queue.add(ahead_s, waited_s)

    def terms(self) -> dict[str, float]:
        out = {t: round(b, 4) for t, b in zip(TERMS, self.beta, strict=True)}
        out["queue"] = round((self.pool or self).queue.value, 4)
        if self.pool is not None:
            out["compute_speed"], out["load_speed"] = (round(f, 4) for f in self.factors)
        return out
