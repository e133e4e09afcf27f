"""What `ddpjob verify` concludes from two runs of one job (launch/verify.py runs them,
launch/verifyfacts.py reads them): the reference, run through, and one interrupted.

Facts first, then the inference. The facts: every value each step logged, the step the run
resumed from, what the loop held outside `state` at the start of every step (each rank's view,
by content), each rank's `state` at the end, the RNG streams and PerRank values of the last
checkpoint, and, where a difference comes before the resume, a second uninterrupted run. The
cause is read from the first thing that differs after the resume; a difference before it is
non-determinism only when the second uninterrupted run differs too. Pure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ddpjob.launch.verifyfacts import Views

# Below this relative difference at the first differing loss, the same data met other
# arithmetic (a reduction order, a kernel): only possible on GPUs without deterministic kernels.
ARITHMETIC_RTOL = 1e-5
# A resume at another world size is "close" when every loss and logged number is within this of
# the reference's: the ranks' dropout streams and the order of the gradient sums change, nothing
# else may. The parameters' distance is reported, not judged (Adam's normalised updates move
# them apart faster than SGD's while the losses agree).
CLOSE_RTOL = 0.05
Scalars = dict[int, dict[str, "float | str"]]
OBJECTS = ("optimizer", "scaler", "scheduler", "stateful")
RESTARTS = {  # what an object of the loop's that is not in `state` does at a resume
    "optimizer": "an optimizer outside `state` starts again at a resume, without its moments and step counts",
    "scaler": "a GradScaler outside `state` starts again at its initial scale at a resume",
    "scheduler": "an LR scheduler outside `state` starts its schedule again at a resume",
    "stateful": "an object with state_dict() outside `state` starts again as built at a resume",
}


@dataclass(frozen=True)
class Twin:
    """A second uninterrupted run against the first: where it differs, if anywhere."""

    step: int | None  # the first logged step that differs, None if none
    generators: list[str] = field(default_factory=list)  # own generators differing from the start


@dataclass
class Facts:
    """What differs between the reference and one interrupted run."""

    at: int  # the step at which the run was interrupted
    resumed: int | None  # the step it resumed from (None: it never restarted)
    ref: Scalars  # step -> logged values, the reference's
    got: Scalars  # the interrupted run's (each name's newest record)
    ref_views: Views = field(default_factory=dict)
    got_views: Views = field(default_factory=dict)
    state_files: dict[str, float] = field(default_factory=dict)  # "optimizer.pt: state.0.exp_avg" -> rel
    rng_ranks: dict[int, str] = field(default_factory=dict)  # rank -> the first differing RNG stream
    per_rank_values: list[tuple[str, int]] = field(default_factory=list)  # (PerRank key, rank) differing
    copied: list[tuple[str, int]] = field(default_factory=list)  # (key, rank): rank holds rank 0's after the resume
    arithmetic: bool = False  # may the arithmetic differ (GPUs without deterministic kernels)?
    twin: Twin | None = None


@dataclass(frozen=True)
class Verdict:
    ok: bool
    line: str
    cause: str = ""  # a short class, for tests and scripts


def first_difference(ref: Scalars, got: Scalars, skip: frozenset[str] = frozenset()) -> tuple[int, list[str]] | None:
    """The first logged step where a value differs (or is missing in one run), and the names;
    `skip`: names left out (a clock's, noise())."""
    for step in sorted(set(ref) | set(got)):
        a, b = ref.get(step, {}), got.get(step, {})
        names = sorted((n for n in set(a) | set(b) if n not in skip and not _same(a.get(n), b.get(n))),
                       key=lambda n: (n != "loss", n))
        if names:
            return step, names
    return None


def _same(a: float | str | None, b: float | str | None) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


# names of a clock's values (ddpjob's own step_ms, data_ms, img_s, eval_s; a user's dt, mfu):
# they differ between any two runs, so they are not compared
CLOCKS = ("_s", "_ms", "_sec", "_seconds", "time", "per_s", "per_sec", "throughput", "mfu", "dt")


def noise(f: Facts) -> frozenset[str]:
    """Logged names not compared: a clock's by its name, and names other than the loss that
    differ before the resume while every loss there is equal (a clock's values too)."""
    r = _resumed(f)
    names = {n for v in f.ref.values() for n in v}
    clocks = {n for n in names if n != "loss" and n.lower().endswith(CLOCKS)}
    before = [s for s in f.ref if s <= r]
    if any(not _same(f.ref[s].get("loss"), f.got.get(s, {}).get("loss")) for s in before):
        return frozenset(clocks)
    return frozenset(clocks | {n for s in before for n, v in f.ref[s].items()
                               if n != "loss" and not _same(v, f.got.get(s, {}).get(n))})


def _first(f: Facts) -> tuple[int, list[str]] | None:
    return first_difference(f.ref, f.got, noise(f))


def needs_twin(f: Facts) -> bool:
    """A value differs at or before the step the run resumed from: only a second uninterrupted
    run can tell non-determinism from anything else."""
    first = _first(f)
    return first is not None and first[0] <= _resumed(f)


def _resumed(f: Facts) -> int:
    return f.resumed if f.resumed is not None else f.at


def shown(a: object, b: object) -> str:
    """'a vs b' with as many digits as it takes for them to differ."""
    if isinstance(a, float) and isinstance(b, float):
        for digits in range(6, 18):  # one digit more than it takes: 6.7941308 vs 6.7941303, not 6.794131 vs 6.79413
            if f"{a:.{digits}g}" != f"{b:.{digits}g}":
                return f"{a:.{digits + 1}g} vs {b:.{digits + 1}g}"
    return f"{a} vs {b}" if a is not None and b is not None else "missing in one run"


def diagnose(f: Facts) -> Verdict:
    """Exact, or what differs first after the resume and its cause, in one line."""
    first = _first(f)
    losses = sum(1 for v in f.ref.values() if "loss" in v)
    if first is None and not f.state_files and not f.rng_ranks and not f.per_rank_values:
        return Verdict(True, f"exact ({losses} losses, every logged value and every tensor of the final state equal)")
    r = _resumed(f)
    if first is None:
        keys = _keys(f.state_files)
        return Verdict(False, f"every logged value is equal, but {keys or 'the RNG files'} differ at the end (first: "
                       f"{min(f.state_files, default='-')}): a `state` object that is saved but not restored as it "
                       "was (its load_state_dict)", "state")
    step, names = first
    what = _what(f, step, names)
    if step <= r:
        return _before_resume(f, what, r)
    if f.copied:
        key, rank = f.copied[0]
        return Verdict(False, f"rank {rank}'s `{key}` equals rank 0's after the resume at step {r} ({what}): a "
                       "per-rank object or value saved through `state` (rank 0's is saved and loaded into every "
                       f"rank): state[{key!r}] = ddpjob.PerRank(obj) (a plain value inside an object with "
                       "state_dict())", "per-rank")
    held = _held(f, r, ("generator",) + OBJECTS + ("tensor",), what)
    if held is not None:
        return held
    if "loss" not in names:
        name = names[0]
        return Verdict(False, f"`{name}` differs from step {step} ({shown(f.ref.get(step, {}).get(name), f.got.get(step, {}).get(name))}), "
                       f"the first step after the resume at step {r} where a logged value differs: a value the "
                       "loop changes that is not in `state`", "outside-value")
    batch = _batch(f, step)
    if batch is not None:
        return batch
    value = _held(f, r, ("number", "text"), what)
    if value is not None:
        return value
    if f.per_rank_values:
        key, rank = f.per_rank_values[0]
        return Verdict(False, f"{what}; rank {rank}'s PerRank `{key}` differs at the end: its load_state_dict does "
                       "not restore what its state_dict saved", "per-rank-value")
    if f.rng_ranks:
        rank, stream = next(iter(sorted(f.rng_ranks.items())))
        return Verdict(False, f"{what}; rank {rank}'s RNG stream `{stream}` differs at the end: the resumed run drew "
                       "another number of random numbers than the uninterrupted one", "rng")
    a, b = f.ref[step].get("loss"), f.got.get(step, {}).get("loss")
    if f.arithmetic and isinstance(a, float) and isinstance(b, float) and abs(a - b) <= ARITHMETIC_RTOL * max(abs(a), 1e-12):
        return Verdict(False, f"{what}; only the arithmetic (relative {abs(a - b) / max(abs(a), 1e-12):.1e}): "
                       "non-deterministic kernels (train.deterministic)", "arithmetic")
    return Verdict(False, f"{what}; nothing the loop holds outside `state` differs before it (its variables, "
                   "generators, RNG streams): data it reads from a source verify does not see, e.g. an iterator "
                   "kept inside another object, made before `resume()`", "unseen")


def _what(f: Facts, step: int, names: list[str]) -> str:
    a, b = f.ref.get(step, {}), f.got.get(step, {})
    n = sum(1 for s in f.ref if not _same(f.ref[s].get("loss"), f.got.get(s, {}).get("loss")))
    name = names[0]
    head = f"losses differ from step {step}" if name == "loss" else f"`{name}` differs from step {step}"
    return f"{head} ({shown(a.get(name), b.get(name))}), {n} of {len(f.ref)} losses"


def _keys(files: dict[str, float]) -> str:
    names = sorted({k.split(":")[0][:-3] for k in files if k.endswith(".pt") or ".pt:" in k})
    return ("state keys " + ", ".join(f"`{n}`" for n in names)) if names else ""


def _before_resume(f: Facts, what: str, r: int) -> Verdict:
    if f.twin is None:
        return Verdict(False, f"{what}, at or before the resume at step {r} (no second uninterrupted run to tell "
                       "why)", "before-resume")
    if f.twin.step is None:
        return Verdict(False, f"{what}, at or before the resume at step {r}, while a second uninterrupted run "
                       "equals the first: the run's first attempt ran otherwise (the loop reads something the "
                       "interruption changes, such as the checkpoint schedule)", "before-resume")
    if f.twin.generators:
        cause = f"the generator `{f.twin.generators[0]}` differs between them from their start: an unseeded generator"
    elif f.arithmetic:
        cause = "data drawn from an unseeded source, or non-deterministic kernels (train.deterministic)"
    else:
        cause = "data drawn from an unseeded source (on CPU with deterministic kernels the arithmetic cannot differ)"
    return Verdict(False, f"{what}, before the resume at step {r}, and a second uninterrupted run differs from "
                   f"the first from step {f.twin.step}: the run is not deterministic: {cause}", "nondeterministic")


def _differing(f: Facts, step: int, kinds: tuple[str, ...]) -> list[tuple[str, int, tuple, tuple]]:
    """(name, rank, ref entry, got entry) of the loop's variables present in both runs at the start
    of index `step` that differ, of the kinds given; numbers and text that also differ before
    the resume (a clock, a pid) are noise, left out."""
    out = []
    r = _resumed(f)
    for rank, mine in sorted(f.ref_views.items()):
        a, b = mine.get(step, {}), f.got_views.get(rank, {}).get(step, {})
        for name in sorted(set(a) & set(b)):
            x, y = a[name], b[name]
            if x[1] == y[1] or x[0].split(":")[0] not in kinds:
                continue
            if x[0] in ("number", "text") and (_noisy(f, rank, name, r) or (x[2], y[2]) == ("0", str(r))):
                continue  # noise, or the step job.resume() returned
            out.append((name, rank, x, y))
    return out


def _noisy(f: Facts, rank: int, name: str, r: int) -> bool:
    ref, got = f.ref_views.get(rank, {}), f.got_views.get(rank, {})
    return any(name in ref[s] and name in got.get(s, {}) and ref[s][name][1] != got[s][name][1]
               for s in ref if s < r)


def _held(f: Facts, r: int, kinds: tuple[str, ...], what: str = "") -> Verdict | None:
    """The first of `kinds` the loop held outside `state` that differs at the start of the first
    resumed step (index r, logged as step r + 1)."""
    found = _differing(f, r, kinds)
    if not found:
        return None
    rank_of = {name: rank for name, rank, _, _ in reversed(found)}
    for kind in kinds:
        names = [n for n, _, x, _ in found if x[0].split(":")[0] == kind]
        if not names:
            continue
        name, (_, _, x, y) = names[0], next(t for t in found if t[0] == names[0])
        where = f"at the start of step {r + 1}, the first after the resume" + (f" ({what})" if what else "")
        rank = f" (rank {rank_of[name]})" if rank_of[name] else ""
        if kind == "generator":
            own = f"ddpjob.PerRank({name})" if x[2] in ("torch.Generator", "") else \
                f"ddpjob.PerRank(obj), obj's state_dict() holding {name}'s state"
            return Verdict(False, f"the generator `{name}`{rank}, not in `state`, differs {where}: an own generator "
                           f"outside `state` starts again from its seed at a resume: put it in `state` ({own})",
                           "outside-generator")
        if kind in OBJECTS:
            return Verdict(False, f"`{name}` ({x[2]}), not in `state`, differs {where}: {RESTARTS[kind]}: "
                           f"state[{name!r}] = {name}", f"outside-{kind}")
        if kind == "tensor":
            if y[0] == "tensor:zeros" and x[0] != "tensor:zeros":
                return Verdict(False, f"`{name}`{rank} is zeros {where}, the uninterrupted run's is not: a carried "
                               "state (an RNN hidden state) re-initialised at the resume: keep it in `state` (a "
                               "PerRank holder: each rank carries its own)", "carried")
            carried = ", or a carried state" if x[0] != "tensor:int" else ""
            return Verdict(False, f"`{name}`{rank}, a tensor held from before the step, differs {where}: a batch "
                           f"drawn before the loop or prefetched (drawn before the step ends){carried}, held outside "
                           "`state`", "prefetch")
        others = [n for n in names[1:3]]
        also = f" (also {', '.join(f'`{n}`' for n in others)})" if others else ""
        return Verdict(False, f"`{name}`{rank} ({shown(_num(x[2]), _num(y[2]))}){also} differs {where}: a value the "
                       "loop changes that is not in `state`", "outside-value")
    return None


def _num(text: str) -> object:
    try:
        return float(text)
    except ValueError:
        return text


def _batch(f: Facts, step: int) -> Verdict | None:
    """The batch of logged step `step` (the loop's tensors at the start of the next index), when
    it differs: and whether it is one the uninterrupted run used earlier (the data restarted)."""
    found = _differing(f, step, ("tensor",))
    if not found:
        return None
    def earlier(name: str, rank: int, digest: str) -> list[int]:
        return [s for s, v in sorted(f.ref_views.get(rank, {}).items()) if s < step and v.get(name, ("", ""))[1] == digest]

    # a batch seen before in the uninterrupted run first, then a batch of token ids, then any tensor
    # (the lowest rank and name among equals: one run's line reads as the next one's)
    name, rank, _, y = min(found, key=lambda t: (not earlier(t[0], t[1], t[3][1]), t[3][0] != "tensor:int",
                                                 t[1], t[0]))
    what = _what(f, step, ["loss"])
    seen = earlier(name, rank, y[1])
    if seen:
        return Verdict(False, f"{what}; the batch of step {step} (`{name}`) is the uninterrupted run's batch of step "
                       f"{seen[0]}: the data starts again after the resume (an iterator that restarts at batch 0): "
                       "draw batches from a StepSampler in `state`, its iterator made after `resume()`", "data-order")
    return Verdict(False, f"{what}; the batch of step {step} (`{name}`) differs: the data order after the resume is "
                   "not the uninterrupted run's (an iterator, sampler or data source not in `state`)", "data-order")


def close(f: Facts, params: tuple[float, str], rtol: float = CLOSE_RTOL) -> Verdict:
    """A resume at another world size: every loss and logged number within `rtol` of the
    reference's; the final parameters' relative L2 distance (`params`, with the tensor that
    differs most) reported beside."""
    worst, skip = (0.0, "loss", 0), noise(f)
    for step, values in sorted(f.ref.items()):
        for name, a in values.items():
            if name in skip:
                continue
            b = f.got.get(step, {}).get(name)
            if b is None:
                return Verdict(False, f"the `{name}` of step {step} is missing after the resume", "data")
            if isinstance(a, float) and isinstance(b, float) and not _same(a, b):
                rel = abs(a - b) / max(abs(a), abs(b), 1e-12)
                if rel > worst[0]:
                    worst = (rel, name, step)
    rel, name, step = worst
    distance, tensor = params
    line = (f"largest difference {rel:.2%} (`{name}`, step {step}), final parameters {distance:.2%} apart (most in "
            f"{tensor or '-'}); tolerance {rtol:.0%}")
    if rel <= rtol:
        return Verdict(True, f"close: {line}")
    r = _resumed(f)
    if name != "loss":
        a, b = f.ref[step][name], f.got[step][name]
        if b not in {v.get(name) for s, v in f.ref.items() if s <= step}:  # one it never had by then
            return Verdict(False, f"not close: {line}: `{name}` differs from step {step} ({shown(a, b)}), a value "
                           "the uninterrupted run never had: the loop computes it from the world size", "world-size")
        return Verdict(False, f"not close: {line}: `{name}` differs from step {step} ({shown(a, b)}): a value the "
                       "loop changes that is not in `state`", "outside-value")
    held = _held(Facts(f.at, f.resumed, f.ref, f.got, {0: f.ref_views.get(0, {})}, {0: f.got_views.get(0, {})}),
                 r, ("generator",) + OBJECTS)
    if held is not None:
        return Verdict(False, f"not close: {line}; {held.line}", held.cause)
    return Verdict(False, f"not close: {line}: the data order or the batch depends on the world size "
                   "(a per-rank batch, a sampler split by rank)", "world-size")


# ------------------------------------------------------------------ the end's facts, sorted
def split_files(diffs: dict[str, float], f: Facts) -> None:
    """rank-R.pt differences: a PerRank value (its `per_rank` entry) or an RNG stream; the rest
    are the state's."""
    for key, rel in diffs.items():
        name, _, inner = key.partition(": ")
        if name.startswith("rank-") and name[5:-3].isdigit():
            rank, parts = int(name[5:-3]), inner.split(".")
            if parts[0] == "per_rank" and len(parts) > 1:
                if (parts[1], rank) not in f.per_rank_values:
                    f.per_rank_values.append((parts[1], rank))
            else:
                f.rng_ranks.setdefault(rank, parts[0] or "the file")
        else:
            f.state_files[key] = rel


def digest_facts(f: Facts, ref: dict[int, dict], got: dict[int, dict]) -> None:
    """The `state` keys the reference's ranks hold differently (per rank) that a rank of the run
    holds as rank 0 does after the resume: saved from rank 0 and loaded into every rank."""
    base = ref.get(0, {}).get("state", {})
    for key in sorted(base):
        if any(r.get("state", {}).get(key) != base[key] for r in ref.values()):
            mine = got.get(0, {}).get("state", {}).get(key)
            f.copied += [(key, rank) for rank, r in sorted(got.items())
                         if rank and r.get("state", {}).get(key) == mine != ref.get(rank, {}).get("state", {}).get(key)]


def twin(ref: Scalars, other: Scalars, ref_views: Views, other_views: Views) -> Twin:
    """A second uninterrupted run against the first: its first step whose loss differs, and the
    own generators that differ at the start of their first step (unseeded)."""
    losses = {s: {"loss": v["loss"]} for s, v in ref.items() if "loss" in v}  # a clock's values differ anyway
    first = first_difference(losses, {s: {"loss": v["loss"]} for s, v in other.items() if "loss" in v})
    gens = []
    for rank, mine in sorted(ref_views.items()):
        if not mine:
            continue
        start = min(mine)
        theirs = other_views.get(rank, {}).get(start, {})
        gens += [f"{n}" + (f" (rank {rank})" if rank else "") for n, e in sorted(mine[start].items())
                 if e[0] == "generator" and n in theirs and theirs[n][1] != e[1]]
    return Twin(first[0] if first else None, gens)
