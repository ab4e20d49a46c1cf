"""Re-rank a `generate --cache` under a whole grid of settings at once, in JAX.

Why: every setting of the paper's ablations (weights, threshold and its rule, sequence
score, hard constraints -- Fig. 3) only changes which cached candidate wins, so a grid of
10,000 settings costs a few array passes instead of 10,000 decoding runs. So does the
retrieval depth: each candidate is decoded from its own passage, so `ndocs=K` (each
question's first K cached candidates, the retriever's top K) re-ranks what `generate
--ndocs K` would decode.

Layout: questions padded to K candidates (`valid` masks the padding); per candidate the
host precomputes exp(seq), rel, sup and use in float64 exactly as `scoring` does, whether
IsRel/IsSup labels trip the hard constraints, whether its text `match`es the gold, and (for
closed-set tasks) the id of its normalised answer, so the device only adds, masks and takes
arg-maxes. Retrieval decisions depend on (mode, rule, threshold) alone: the host evaluates
each distinct one with `scoring.decide_retrieve` (float64, the same comparison `generate`
makes) and the kernel gathers rows of that table; the retriever prior (a softmax over the
kept candidates, not linear in its temperature) is tabled the same way per distinct
(temperature, ndocs). Arrays are [Q, K, G] with the grid last; the grid axis is sharded
over a 1-D mesh of the local devices, in chunks that bound memory.
With several processes each takes a contiguous share of the grid; process 0 gathers.
Choices follow `scoring.choose`: first index wins ties, closed sets sum final scores per
answer (a segment sum over host-computed answer ids) and break exact ties by the answer
seen first among kept candidates. Scores are float32 on the device (float64 on the host),
so only near-ties closer than ~1e-7 could rank differently.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from selfrag_jax.inference import scoring
from selfrag_jax.inference.cache import SweepCache, retriever_probs

# key -> (default, kind); the order is the CSV's column order and the grid's nesting order.
PARAMS: dict[str, tuple[Any, str]] = {
    "mode": ("adaptive", "choice"), "rule": ("paper", "choice"), "threshold": (0.2, "float"),
    "seqscore": ("on", "choice"), "hard": ("none", "choice"), "ndocs": (0, "int"),
    "w_rel": (1.0, "float"), "w_sup": (1.0, "float"), "w_use": (0.5, "float"),
    "w_ret": (0.0, "float"), "ret_temperature": (0.05, "float"),
}
CHOICES = {"mode": scoring.MODES, "rule": scoring.THRESHOLD_RULES, "seqscore": ("on", "off"),
           "hard": ("none", "no_support", "irrelevant", "both")}


# --- the grid -------------------------------------------------------------------------
@dataclass(frozen=True)
class Config:
    mode: str = "adaptive"
    rule: str = "paper"
    threshold: float = 0.2
    seqscore: str = "on"
    hard: str = "none"
    ndocs: int = 0  # retrieval depth: each question's first K cached candidates (0: all of them)
    w_rel: float = 1.0
    w_sup: float = 1.0
    w_use: float = 0.5
    w_ret: float = 0.0
    ret_temperature: float = 0.05

    def options(self) -> tuple[scoring.RetrieveOptions, scoring.ScoreOptions]:
        """The `generate` options this configuration stands for."""
        return (scoring.RetrieveOptions(self.mode, self.threshold, self.rule),
                scoring.ScoreOptions(self.w_rel, self.w_sup, self.w_use, self.seqscore == "on",
                                     self.hard in ("no_support", "both"), self.hard in ("irrelevant", "both"),
                                     self.w_ret, self.ret_temperature))

    def generate_flags(self) -> list[str]:
        flags = ["--mode", self.mode, "--threshold-rule", self.rule, "--threshold", repr(self.threshold),
                 "--w-rel", repr(self.w_rel), "--w-sup", repr(self.w_sup), "--w-use", repr(self.w_use),
                 "--w-ret", repr(self.w_ret), "--ret-temperature", repr(self.ret_temperature)]
        flags += ["--ndocs", str(self.ndocs)] if self.ndocs else []
        flags += ["--no-seqscore"] if self.seqscore == "off" else []
        flags += ["--drop-no-support"] if self.hard in ("no_support", "both") else []
        flags += ["--drop-irrelevant"] if self.hard in ("irrelevant", "both") else []
        return flags


def parse_grid(spec: str) -> dict[str, list]:
    """`w_rel=0:2:5,rule=paper|released,...` (start:stop:count inclusive, or `a|b|c`),
    or the path of a YAML/JSON mapping of the same keys to a list, "a:b:n" or a scalar."""
    path = Path(spec)
    if spec.endswith((".yaml", ".yml", ".json")) or path.is_file():
        if not path.is_file():
            raise ValueError(f"{spec}: grid file not found")
        import yaml

        raw = yaml.safe_load(path.read_text())
        if not isinstance(raw, dict):
            raise ValueError(f"{spec}: a grid file is a mapping of parameter -> values")
        items = [(str(k), v) for k, v in raw.items()]
    else:
        items = []
        for part in filter(None, (p.strip() for p in spec.split(","))):
            if "=" not in part:
                raise ValueError(f"grid: {part!r} is not key=values")
            key, value = part.split("=", 1)
            items.append((key.strip(), value.strip()))
    grid = {key: [default] for key, (default, _) in PARAMS.items()}
    for key, value in items:
        grid[key] = _values(key, value)
    return grid


def _values(key: str, value) -> list:
    if key not in PARAMS:
        raise ValueError(f"grid: unknown parameter {key!r} (known: {', '.join(PARAMS)})")
    kind = PARAMS[key][1]
    if isinstance(value, list):
        values = value
    elif isinstance(value, str) and kind in ("float", "int") and value.count(":") == 2:
        start, stop, count = value.split(":")
        try:
            values = np.linspace(float(start), float(stop), int(count)).round(10).tolist()
        except ValueError:
            raise ValueError(f"grid: {key}={value!r} is not start:stop:count") from None
    elif isinstance(value, str):
        values = value.split("|")
    else:
        values = [value]
    if kind == "float":
        try:
            values = [float(v) for v in values]
        except (TypeError, ValueError):
            raise ValueError(f"grid: {key} takes numbers, got {value!r}") from None
    elif kind == "int":
        try:
            numbers = [float(v) for v in values]
        except (TypeError, ValueError):
            raise ValueError(f"grid: {key} takes whole numbers, got {value!r}") from None
        if any(n != int(n) or n < 0 for n in numbers):
            raise ValueError(f"grid: {key} takes whole numbers >= 0, got {value!r}")
        values = [int(n) for n in numbers]
    else:
        values = [{True: "on", False: "off"}.get(v, str(v)) for v in values]
        bad = [v for v in values if v not in CHOICES[key]]
        if bad:
            raise ValueError(f"grid: {key}={bad[0]!r} is not one of {'|'.join(CHOICES[key])}")
    if not values:
        raise ValueError(f"grid: {key} has no values")
    if key == "ret_temperature" and min(values) <= 0:
        raise ValueError(f"grid: ret_temperature must be positive, got {min(values)}")
    return values


def expand(grid: dict[str, list]) -> list[Config]:
    return [Config(**dict(zip(PARAMS, combo))) for combo in itertools.product(*(grid[k] for k in PARAMS))]


# --- host-side preparation ------------------------------------------------------------
@dataclass
class Prepared:
    """The cache as padded [Q, K] arrays, plus what the metric needs."""

    seq_exp: np.ndarray
    rel: np.ndarray
    sup: np.ndarray
    use: np.ndarray
    valid: np.ndarray  # bool: a real candidate (not padding)
    rows: np.ndarray  # int: the cache row of each [Q, K] cell (0 in padding)
    irrelevant: np.ndarray  # bool: generated [Irrelevant]
    no_support: np.ndarray  # bool: generated [No support / Contradictory]
    answer_id: np.ndarray  # int32: id of the candidate's normalised answer within its question
    match: np.ndarray  # float32: the candidate's text matches the gold
    match_nr: np.ndarray  # float32 [Q]: the no-retrieval answer matches
    has_candidates: np.ndarray  # bool [Q]
    closed: bool
    cache: SweepCache = field(repr=False)

    @property
    def shape(self) -> tuple[int, int]:
        return self.valid.shape


def prepare(cache: SweepCache, task: str | None = None) -> Prepared:
    """Pad the cache to [Q, K] and precompute everything that does not depend on the grid.
    `task` names the eval task whose gold rules the metric uses (default: the cache's)."""
    a, gen_task = cache.arrays, cache.meta["task"]
    q_n = len(cache.questions)
    counts = a["q_cand_count"].astype(np.int64)
    k_n = max(int(counts.max(initial=0)), 1)
    rows = a["q_cand_start"][:, None] + np.arange(k_n)[None, :]
    valid = np.arange(k_n)[None, :] < counts[:, None]
    rows = np.where(valid, rows, 0)
    if len(a["c_seq"]) == 0:
        rows = np.zeros_like(rows)

    def padded(values: np.ndarray, fill=0) -> np.ndarray:
        return _gather(values, rows, valid, fill)

    sup = scoring.sup_score(a["c_sup_probs"], a["c_sup_found"])
    use = scoring.use_score(a["c_use_probs"], a["c_use_found"])
    answers_of = _gold_rule(task or gen_task)
    match, match_nr, answer_id = np.zeros((q_n, k_n), np.float32), np.zeros(q_n, np.float32), np.zeros((q_n, k_n), np.int32)
    from selfrag_jax.evaluation.metrics import match as released_match

    for q, line in enumerate(cache.questions):
        gold = answers_of(line)
        match_nr[q] = released_match(line["no_retrieval"]["text"], gold)
        ids: dict[str, int] = {}
        for k, cand in enumerate(line["candidates"]):
            match[q, k] = released_match(cand["text"], gold)
            answer_id[q, k] = ids.setdefault(cand["norm"], len(ids))
    return Prepared(
        seq_exp=padded(np.exp(a["c_seq"].astype(np.float64))).astype(np.float32),
        rel=padded(a["c_rel"].astype(np.float64)).astype(np.float32),
        sup=padded(sup).astype(np.float32), use=padded(use).astype(np.float32), valid=valid, rows=rows,
        irrelevant=padded(a["c_rel_label"] == scoring.IRRELEVANT, False),
        no_support=padded(a["c_sup_label"] == scoring.NO_SUPPORT, False),
        answer_id=answer_id, match=match, match_nr=match_nr, has_candidates=counts > 0,
        closed=gen_task in scoring.CLOSED_TASKS, cache=cache)


def _gather(values: np.ndarray, rows: np.ndarray, valid: np.ndarray, fill=0) -> np.ndarray:
    """Per-candidate `values` [C] as padded [Q, K] (`fill` in padding)."""
    values = np.asarray(values)
    if len(values) == 0:
        return np.full(valid.shape, fill, values.dtype)
    return np.where(valid, values[rows], fill)


def _gold_rule(task: str) -> Callable[[dict], list[str]]:
    """Gold answers of a cache line under the eval task's rules (`eval`'s TASKS)."""
    from selfrag_jax.evaluation.evaluate import TASKS, TaskSpec, gold_answers

    spec = TASKS.get(task) or {"fever": TaskSpec("factcheck"), "arc_c": TaskSpec("mc")}.get(task, TaskSpec("short"))
    return lambda line: gold_answers(spec, line)


def decision_table(prep: Prepared, configs: list[Config]) -> tuple[np.ndarray, np.ndarray]:
    """([D, Q] bool retrieve decisions of each distinct (mode, rule, threshold), [G] row per config)."""
    a = prep.cache.arrays
    keys = [(c.mode, c.rule, c.threshold) for c in configs]
    distinct = list(dict.fromkeys(keys))
    table = np.stack([scoring.decide_retrieve(a["q_retrieve_logprobs"], a["q_greedy_retrieval"],
                                              scoring.RetrieveOptions(m, t, r)) for m, r, t in distinct])
    index = {k: i for i, k in enumerate(distinct)}
    return table & prep.has_candidates[None, :], np.array([index[k] for k in keys], np.int32)


def prior_table(prep: Prepared, configs: list[Config]) -> tuple[np.ndarray, np.ndarray]:
    """([T, Q, K] `scoring.retriever_prob` of each distinct (temperature, depth), [G] row per
    config), on the host in float64 like the decisions: the softmax is the one non-linear score."""
    keys = list(dict.fromkeys((c.ret_temperature, c.ndocs) for c in configs))
    table = np.stack([_gather(retriever_probs(prep.cache, t, n), prep.rows, prep.valid, 0.0) for t, n in keys])
    index = {k: i for i, k in enumerate(keys)}
    return table.astype(np.float32), np.array([index[c.ret_temperature, c.ndocs] for c in configs], np.int32)


def check_depths(prep: Prepared, configs: list[Config]) -> None:
    """A depth below the cache's re-ranks the retriever's top K, which a cache with corrective
    re-retrieval does not keep in rank order (later rounds' passages follow the first's)."""
    if any(c.ndocs for c in configs) and (prep.cache.meta.get("options", {}).get("corrective") or {}).get("enabled"):
        raise ValueError("grid: ndocs cannot re-rank a cache written with corrective re-retrieval")


# --- the kernel -----------------------------------------------------------------------
def _kernel(q: dict, cfg: dict, closed: bool, with_choices: bool):
    """Per configuration (last axis): metric, retrieval frequency [, chosen, retrieved]."""
    import jax
    import jax.numpy as jnp

    q_n, k_n = q["valid"].shape
    w = cfg["w"]  # [G, 3]
    final = (q["seq_exp"][..., None] * cfg["seq_on"] + q["rel"][..., None] * w[:, 0]
             + q["sup"][..., None] * w[:, 1] + q["use"][..., None] * w[:, 2]
             + jnp.moveaxis(q["priors"][cfg["prior"]], 0, -1) * cfg["w_ret"])  # [Q, K, G]
    keep = (q["valid"][..., None] & (jnp.arange(k_n)[None, :, None] < cfg["depth"])
            & ~(q["irrelevant"][..., None] & cfg["drop_irr"])
            & ~(q["no_support"][..., None] & cfg["drop_nosup"]))
    if closed:  # sum per answer: segment ids q * K + answer id, grid kept as a trailing axis
        seg = (jnp.arange(q_n)[:, None] * k_n + q["answer_id"]).reshape(-1)
        flat = lambda x: x.reshape(q_n * k_n, -1)  # noqa: E731
        segs = lambda x, op: op(flat(x), seg, num_segments=q_n * k_n).reshape(q_n, k_n, -1)  # noqa: E731
        totals = segs(jnp.where(keep, final, 0.0), jax.ops.segment_sum)
        present = segs(keep.astype(jnp.int32), jax.ops.segment_sum) > 0
        first = segs(jnp.where(keep, jnp.arange(k_n)[None, :, None], k_n), jax.ops.segment_min)
        best = jnp.max(jnp.where(present, totals, -jnp.inf), axis=1, keepdims=True)
        winner = jnp.argmin(jnp.where(present & (totals == best), first, k_n + 1), axis=1)  # [Q, G]
        keep_best = keep & (q["answer_id"][..., None] == winner[:, None, :])
    else:
        keep_best = keep
    chosen = jnp.argmax(jnp.where(keep_best, final, -jnp.inf), axis=1)  # [Q, G]
    retrieved = q["decisions"][cfg["decision"]].T  # [Q, G]
    use_candidate = retrieved & keep.any(axis=1)
    correct = jnp.where(use_candidate, jnp.take_along_axis(q["match"], chosen, axis=1), q["match_nr"][:, None])
    out = {"metric": correct.mean(axis=0), "retrieval_frequency": retrieved.mean(axis=0)}
    if with_choices:
        out.update(chosen=jnp.where(use_candidate, chosen, -1), retrieved=retrieved)
    return out


@dataclass
class SweepResult:
    configs: list[Config]
    metric: np.ndarray  # [G] mean released match
    retrieval_frequency: np.ndarray  # [G]
    chosen: np.ndarray | None = None  # [G, Q] candidate index, -1: the no-retrieval answer
    retrieved: np.ndarray | None = None  # [G, Q]
    devices: int = 1
    chunk: int = 0


def run_sweep(prep: Prepared, configs: list[Config], *, with_choices: bool = False, chunk: int | None = None,
              devices=None, progress: bool = False) -> SweepResult:
    """Evaluate `configs` on this process's devices (see `sweep_all_hosts` for pods)."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    devices = list(devices or jax.local_devices())
    mesh = Mesh(np.array(devices), ("grid",))
    q_n, k_n = prep.shape
    check_depths(prep, configs)
    table, decision = decision_table(prep, configs)
    priors, prior = prior_table(prep, configs)
    rep = NamedSharding(mesh, P())
    q = {k: jax.device_put(v, rep) for k, v in dict(
        seq_exp=prep.seq_exp, rel=prep.rel, sup=prep.sup, use=prep.use, valid=prep.valid,
        irrelevant=prep.irrelevant, no_support=prep.no_support, answer_id=prep.answer_id,
        match=prep.match, match_nr=prep.match_nr, decisions=table, priors=priors).items()}
    chunk = _chunk_size(chunk, len(configs), q_n * k_n, len(devices))
    cfg_all = _config_arrays(configs, decision, prior, k_n)
    shard_g = NamedSharding(mesh, P("grid"))
    out_shardings = {"metric": shard_g, "retrieval_frequency": shard_g}
    if with_choices:
        out_shardings.update(chosen=NamedSharding(mesh, P(None, "grid")), retrieved=NamedSharding(mesh, P(None, "grid")))
    step = jax.jit(lambda qq, cc: _kernel(qq, cc, prep.closed, with_choices), out_shardings=out_shardings)
    parts: dict[str, list[np.ndarray]] = {k: [] for k in out_shardings}
    from selfrag_jax.utils import progress as bar

    with bar(total=len(configs), desc="sweep", unit="cfg", disable=None if progress else True) as pbar:
        for start in range(0, len(configs), chunk):
            n = min(chunk, len(configs) - start)
            cfg = {k: jax.device_put(_pad(v[start:start + n], chunk), NamedSharding(mesh, P("grid", *[None] * (v.ndim - 1))))
                   for k, v in cfg_all.items()}
            out = step(q, cfg)
            for k, v in out.items():
                v = np.asarray(v)
                parts[k].append(v[:n] if v.ndim == 1 else v[:, :n].T)
            pbar.update(n)
    cat = {k: np.concatenate(v) if v else np.zeros(0) for k, v in parts.items()}
    return SweepResult(configs, cat["metric"], cat["retrieval_frequency"], cat.get("chosen"), cat.get("retrieved"),
                       len(devices), chunk)


def _config_arrays(configs: list[Config], decision: np.ndarray, prior: np.ndarray, k_n: int) -> dict[str, np.ndarray]:
    return {
        "depth": np.array([c.ndocs or k_n for c in configs], np.int32),
        "w": np.array([[c.w_rel, c.w_sup, c.w_use] for c in configs], np.float32).reshape(-1, 3),
        "w_ret": np.array([c.w_ret for c in configs], np.float32), "prior": prior,
        "seq_on": np.array([c.seqscore == "on" for c in configs], np.float32),
        "drop_irr": np.array([c.hard in ("irrelevant", "both") for c in configs], bool),
        "drop_nosup": np.array([c.hard in ("no_support", "both") for c in configs], bool),
        "decision": decision,
    }


def _pad(x: np.ndarray, n: int) -> np.ndarray:
    if len(x) == n:
        return x
    return np.concatenate([x, np.repeat(x[-1:], n - len(x), axis=0)])


def _chunk_size(chunk: int | None, n_configs: int, cells: int, n_dev: int, budget_bytes: float = 2**30) -> int:
    """Configurations per compiled step: a multiple of the device count, sized so the
    ~13 float32 [Q, K, chunk] intermediates of one device fit in `budget_bytes`."""
    if chunk is None:
        per_dev = max(1, int(budget_bytes // (cells * 4 * 13)))
        per_dev = min(1 << (per_dev.bit_length() - 1), 4096)
        chunk = per_dev * n_dev
        chunk = min(chunk, -(-n_configs // n_dev) * n_dev)  # no more padding than one round
    return max(n_dev, -(-chunk // n_dev) * n_dev)


def sweep_all_hosts(prep: Prepared, configs: list[Config], **kwargs) -> SweepResult | None:
    """Each process sweeps its contiguous share of the grid on its own devices; process 0
    gathers every share and returns the whole result (None on the other processes)."""
    import jax

    from selfrag_jax.distributed import gather_json

    n_proc, me = jax.process_count(), jax.process_index()
    if n_proc == 1:
        return run_sweep(prep, configs, **kwargs)
    bounds = np.linspace(0, len(configs), n_proc + 1).astype(int)
    mine = run_sweep(prep, configs[bounds[me]:bounds[me + 1]], **kwargs)
    shares = gather_json({"metric": mine.metric.tolist(), "retrieval_frequency": mine.retrieval_frequency.tolist()})
    if me != 0:
        return None
    return SweepResult(configs, np.concatenate([np.asarray(s["metric"], np.float32) for s in shares]),
                       np.concatenate([np.asarray(s["retrieval_frequency"], np.float32) for s in shares]),
                       devices=mine.devices * n_proc, chunk=mine.chunk)


def result_rows(result: SweepResult) -> list[dict[str, Any]]:
    return [{"config": i, **c.__dict__, "metric": float(m), "retrieval_frequency": float(f)}
            for i, (c, m, f) in enumerate(zip(result.configs, result.metric, result.retrieval_frequency))]


def to_json(obj) -> str:
    return json.dumps(obj, indent=1, default=float)
