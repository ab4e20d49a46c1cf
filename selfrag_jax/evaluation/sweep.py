"""Re-rank a `generate --cache` under a whole grid of settings at once, in JAX.

Why: every setting of the paper's ablations (weights, threshold and its rule, sequence
score, hard constraints -- Fig. 3) and of this project's refusal bar only changes which
cached candidate wins, so a grid of 10,000 settings costs a few array passes instead of
10,000 decoding runs. So does the retrieval depth: each candidate is decoded from its own
passage, so `ndocs=K` (each question's first K cached candidates, the retriever's top K)
re-ranks what `generate --ndocs K` would decode.

The choice is `candidates.choose`'s own formula (`scoring.combine`, `candidates.keep_mask`,
`candidates.select`) with the grid as a trailing axis: the cache's table padded to [Q, K],
per candidate exp(seq), rel, sup and use precomputed on the host in float64 as `choose`
computes them, so the device only adds, masks and takes arg-maxes ([Q, K, G] arrays, the
grid axis sharded over a 1-D mesh of the local devices, in chunks that bound memory).
What is not linear in a grid value is tabled on the host per distinct value, in float64
like `choose`: the retrieval decisions per (mode, rule, threshold), the retriever prior per
(temperature, depth), the support bar per (rel, sup threshold). With several processes each
takes a contiguous share of the grid; process 0 gathers. Scores are float32 on the device,
so only near-ties closer than ~1e-7 could rank differently from `choose`.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

import numpy as np

from selfrag_jax.inference import scoring
from selfrag_jax.inference.cache import SweepCache
from selfrag_jax.inference.candidates import ChoiceOptions, Table, candidate_scores, keep_mask, retriever_probs, select
from selfrag_jax.inference.scoring import Hard, RefuseOptions, RetrieveOptions, ScoreOptions

_RETRIEVE, _SCORE, _REFUSE = RetrieveOptions(), ScoreOptions(), RefuseOptions()
ON_OFF = ("on", "off")


# --- the grid -------------------------------------------------------------------------
@dataclass(frozen=True)
class Config:
    """One setting of the choice as a flat CSV row; the defaults are the option dataclasses'
    (`generate`'s), and the field order is the CSV's column order and the grid's nesting."""

    mode: str = _RETRIEVE.mode
    rule: str = _RETRIEVE.rule
    threshold: float = _RETRIEVE.threshold
    seqscore: str = ON_OFF[not _SCORE.seqscore]
    hard: str = _SCORE.hard.value
    ndocs: int = 0  # retrieval depth: each question's first K cached candidates (0: all of them)
    w_rel: float = _SCORE.w_rel
    w_sup: float = _SCORE.w_sup
    w_use: float = _SCORE.w_use
    w_ret: float = _SCORE.w_ret
    ret_temperature: float = _SCORE.ret_temperature
    refuse: str = ON_OFF[not _REFUSE.enabled]
    refuse_rel_threshold: float = _REFUSE.rel_threshold
    refuse_sup_threshold: float = _REFUSE.sup_threshold
    refuse_issup: str = ON_OFF[not _REFUSE.issup]
    refuse_ret_threshold: float = _REFUSE.ret_threshold
    refuse_use_threshold: float = _REFUSE.use_threshold

    def options(self, task: str = "open", refusal_message: str = _REFUSE.message) -> ChoiceOptions:
        """The `generate` options this configuration stands for."""
        return ChoiceOptions(
            task=task, ndocs=self.ndocs,
            retrieve=RetrieveOptions(mode=self.mode, threshold=self.threshold, rule=self.rule),
            score=ScoreOptions(w_rel=self.w_rel, w_sup=self.w_sup, w_use=self.w_use, seqscore=self.seqscore == "on",
                               hard=Hard(self.hard), w_ret=self.w_ret, ret_temperature=self.ret_temperature),
            refuse=RefuseOptions(enabled=self.refuse == "on", rel_threshold=self.refuse_rel_threshold,
                                 sup_threshold=self.refuse_sup_threshold, message=refusal_message,
                                 issup=self.refuse_issup == "on", ret_threshold=self.refuse_ret_threshold,
                                 use_threshold=self.refuse_use_threshold))

    def generate_flags(self) -> list[str]:
        flags = ["--mode", self.mode, "--threshold-rule", self.rule, "--threshold", repr(self.threshold),
                 "--w-rel", repr(self.w_rel), "--w-sup", repr(self.w_sup), "--w-use", repr(self.w_use),
                 "--w-ret", repr(self.w_ret), "--ret-temperature", repr(self.ret_temperature),
                 "--refuse" if self.refuse == "on" else "--no-refuse",
                 "--refuse-rel-threshold", repr(self.refuse_rel_threshold),
                 "--refuse-sup-threshold", repr(self.refuse_sup_threshold), "--refuse-issup", self.refuse_issup,
                 f"--refuse-ret-threshold={self.refuse_ret_threshold!r}",
                 f"--refuse-use-threshold={self.refuse_use_threshold!r}"]
        flags += ["--ndocs", str(self.ndocs)] if self.ndocs else []
        flags += ["--no-seqscore"] if self.seqscore == "off" else []
        flags += ["--drop-no-support"] if Hard(self.hard).drops_no_support else []
        flags += ["--drop-irrelevant"] if Hard(self.hard).drops_irrelevant else []
        return flags


CHOICES = {"mode": scoring.MODES, "rule": scoring.THRESHOLD_RULES, "seqscore": ON_OFF,
           "hard": tuple(h.value for h in Hard), "refuse": ON_OFF, "refuse_issup": ON_OFF}
# key -> (default, kind), from Config's fields
PARAMS: dict[str, tuple[Any, str]] = {f.name: (f.default, "choice" if f.name in CHOICES else f.type)
                                      for f in fields(Config)}


def parse_grid(spec: str) -> dict[str, list]:
    """`w_rel=0:2:5,rule=paper|released,...` (start:stop:count inclusive, or `a|b|c`),
    or the path of a YAML/JSON mapping of the same keys to a list, "a:b:n" or a scalar."""
    path = Path(spec)
    if spec.endswith((".yaml", ".yml", ".json")) or ("=" not in spec and path.is_file()):  # a long grid is no path
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
    """The cache's table padded to [Q, K], plus what the metric needs."""

    seq_exp: np.ndarray
    rel: np.ndarray
    sup: np.ndarray
    use: np.ndarray
    valid: np.ndarray  # bool: a real candidate (not padding)
    irrelevant: np.ndarray  # bool: generated [Irrelevant]
    no_support: np.ndarray  # bool: generated [No support / Contradictory]
    answer_id: np.ndarray  # int32: id of the candidate's normalised answer within its question
    match: np.ndarray  # float32: the candidate's text matches the gold
    match_nr: np.ndarray  # float32 [Q]: the no-retrieval answer matches
    match_refusal: np.ndarray  # float32 [Q]: the refusal message matches (a gold answer could be it)
    has_candidates: np.ndarray  # bool [Q]
    closed: bool
    table: Table = field(repr=False)
    parts: dict[str, np.ndarray] = field(repr=False)  # [C] float64 `candidate_scores` (the bar compares them)
    cache: SweepCache = field(repr=False)

    @property
    def shape(self) -> tuple[int, int]:
        return self.valid.shape


def prepare(cache: SweepCache, task: str | None = None) -> Prepared:
    """Pad the cache to [Q, K] and precompute everything that does not depend on the grid.
    `task` names the eval task whose gold rules the metric uses (default: the cache's)."""
    from selfrag_jax.metrics import match as released_match

    table = cache.table()
    parts = candidate_scores(table, ScoreOptions())  # weights do not matter here: the parts do
    q_n, k_n = table.n_questions, table.width
    answers_of, message = _gold_rule(task or cache.task), cache.refuse_options().message
    match, match_nr, match_refusal = np.zeros((q_n, k_n), np.float32), np.zeros(q_n, np.float32), np.zeros(q_n, np.float32)
    for q, line in enumerate(cache.questions):
        gold = answers_of(line)
        match_nr[q], match_refusal[q] = released_match(line["no_retrieval"]["text"], gold), released_match(message, gold)
        for k, cand in enumerate(line["candidates"]):
            match[q, k] = released_match(cand["text"], gold)
    pad = lambda values, fill=0.0: table.padded(values, fill)  # noqa: E731
    return Prepared(
        seq_exp=pad(np.exp(parts["seq"])).astype(np.float32), rel=pad(parts["rel"]).astype(np.float32),
        sup=pad(parts["sup"]).astype(np.float32), use=pad(parts["use"]).astype(np.float32), valid=table.grid[1],
        irrelevant=pad(table.rel_label == scoring.IRRELEVANT, False),
        no_support=pad(table.sup_label == scoring.NO_SUPPORT, False), answer_id=pad(table.answer, 0),
        match=match, match_nr=match_nr, match_refusal=match_refusal, has_candidates=table.cand_count > 0,
        closed=cache.task in scoring.CLOSED_TASKS, table=table, parts=parts, cache=cache)


def _gold_rule(task: str) -> Callable[[dict], list[str]]:
    """Gold answers of a cache line under the eval task's rules (`eval`'s TASKS)."""
    from selfrag_jax.evaluation.evaluate import TASKS, EvalTask, gold_answers

    spec = TASKS.get(task) or {"fever": EvalTask("factcheck"), "arc_c": EvalTask("mc")}.get(task, EvalTask("short"))
    return lambda line: gold_answers(spec, line)


def _tabled(configs: list[Config], key, make) -> tuple[np.ndarray, np.ndarray]:
    """([D, ...] `make(k)` stacked for each distinct `key(config)`, [G] row of each config)."""
    keys = [key(c) for c in configs]
    distinct = list(dict.fromkeys(keys))
    index = {k: i for i, k in enumerate(distinct)}
    return np.stack([make(k) for k in distinct]), np.array([index[k] for k in keys], np.int32)


def decision_table(prep: Prepared, configs: list[Config]) -> tuple[np.ndarray, np.ndarray]:
    """[D, Q] retrieve decisions of each distinct (mode, rule, threshold), as `choose` decides."""
    t = prep.table
    return _tabled(configs, lambda c: (c.mode, c.rule, c.threshold), lambda k: scoring.decide_retrieve(
        t.retrieve_logprobs, t.greedy_retrieval, RetrieveOptions(mode=k[0], rule=k[1], threshold=k[2])))


def prior_table(prep: Prepared, configs: list[Config]) -> tuple[np.ndarray, np.ndarray]:
    """[T, Q, K] retriever prior of each distinct (temperature, depth): the one non-linear score."""
    table, index = _tabled(configs, lambda c: (c.ret_temperature, c.ndocs),
                           lambda k: prep.table.padded(retriever_probs(prep.table, *k), 0.0))
    return table.astype(np.float32), index


def bar_table(prep: Prepared, configs: list[Config]) -> tuple[np.ndarray, np.ndarray]:
    """[B, Q, K] support bar of each distinct (rel, sup threshold, IsSup on, retriever score bar,
    utility bar), compared in float64."""
    t, parts = prep.table, prep.parts
    key = lambda c: (c.refuse_rel_threshold, c.refuse_sup_threshold, c.refuse_issup, c.refuse_ret_threshold,  # noqa: E731
                     c.refuse_use_threshold)
    return _tabled(configs, key, lambda k: t.padded(scoring.passes_bar(
        parts["rel"], parts["sup"], parts["use"], t.sup_label, t.ret_score,
        RefuseOptions(rel_threshold=k[0], sup_threshold=k[1], issup=k[2] == "on", ret_threshold=k[3],
                      use_threshold=k[4])), False))


def check_depths(prep: Prepared, configs: list[Config]) -> None:
    """A depth below the cache's re-ranks the retriever's top K, which a cache with corrective
    re-retrieval does not keep in rank order (later rounds' passages follow the first's)."""
    if any(c.ndocs for c in configs) and (prep.cache.meta.get("options", {}).get("corrective") or {}).get("enabled"):
        raise ValueError("grid: ndocs cannot re-rank a cache written with corrective re-retrieval")


# --- the kernel -----------------------------------------------------------------------
def _kernel(q: dict, cfg: dict, closed: bool, with_choices: bool):
    """Per configuration (last axis): metric, retrieval and refusal rates [, chosen, retrieved, refused]."""
    import jax.numpy as jnp

    k_n = q["valid"].shape[1]
    col = lambda x: x[..., None]  # noqa: E731  [Q, K] -> [Q, K, 1], against the grid axis
    per_config = lambda table, index: jnp.moveaxis(table[index], 0, -1)  # noqa: E731  [G, Q, ...] -> [Q, ..., G]
    final = scoring.combine(col(q["seq_exp"]), col(q["rel"]), col(q["sup"]), col(q["use"]),
                            per_config(q["priors"], cfg["prior"]), cfg["seq_on"], cfg["w_rel"], cfg["w_sup"],
                            cfg["w_use"], cfg["w_ret"])
    keep = keep_mask(col(q["valid"]), jnp.arange(k_n)[None, :, None] < cfg["depth"], jnp.zeros((), bool),
                     col(q["irrelevant"]), col(q["no_support"]), cfg["drop_irr"], cfg["drop_nosup"],
                     per_config(q["bars"], cfg["bar"]), cfg["refuse"])
    decided = per_config(q["decisions"], cfg["decision"])  # [Q, G]
    retrieved = decided & q["has_candidates"][:, None]
    chosen = jnp.where(retrieved, select(jnp, final, keep, q["answer_id"], closed), -1)
    refused = cfg["refuse"] & decided & (chosen < 0)
    correct = jnp.where(chosen >= 0, jnp.take_along_axis(q["match"], jnp.maximum(chosen, 0), axis=1),
                        jnp.where(refused, q["match_refusal"][:, None], q["match_nr"][:, None]))
    out = {"metric": correct.mean(axis=0), "retrieval_frequency": retrieved.mean(axis=0),
           "refusal_rate": refused.mean(axis=0)}
    if with_choices:
        out.update(chosen=chosen, retrieved=retrieved, refused=refused)
    return out


@dataclass
class SweepResult:
    configs: list[Config]
    metric: np.ndarray  # [G] mean released match
    retrieval_frequency: np.ndarray  # [G]
    refusal_rate: np.ndarray  # [G]
    chosen: np.ndarray | None = None  # [G, Q] candidate index, -1: the no-retrieval answer (or a refusal)
    retrieved: np.ndarray | None = None  # [G, Q]
    refused: np.ndarray | None = None  # [G, Q]
    devices: int = 1
    chunk: int = 0


RATES = ("metric", "retrieval_frequency", "refusal_rate")
CHOICE_ARRAYS = ("chosen", "retrieved", "refused")


def run_sweep(prep: Prepared, configs: list[Config], *, with_choices: bool = False, chunk: int | None = None,
              devices=None, progress: bool = False) -> SweepResult:
    """Evaluate `configs` on this process's devices (see `sweep_all_hosts` for pods)."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from selfrag_jax.utils import progress as bar

    devices = list(devices or jax.local_devices())
    mesh = Mesh(np.array(devices), ("grid",))
    q_n, k_n = prep.shape
    check_depths(prep, configs)
    (decisions, decision), (priors, prior), (bars, bar_index) = (
        decision_table(prep, configs), prior_table(prep, configs), bar_table(prep, configs))
    rep = NamedSharding(mesh, P())
    q = {k: jax.device_put(v, rep) for k, v in dict(
        seq_exp=prep.seq_exp, rel=prep.rel, sup=prep.sup, use=prep.use, valid=prep.valid,
        irrelevant=prep.irrelevant, no_support=prep.no_support, answer_id=prep.answer_id, match=prep.match,
        match_nr=prep.match_nr, match_refusal=prep.match_refusal, has_candidates=prep.has_candidates,
        decisions=decisions, priors=priors, bars=bars).items()}
    chunk = _chunk_size(chunk, len(configs), q_n * k_n, len(devices))
    cfg_all = _config_arrays(configs, decision, prior, bar_index, k_n)
    shard_g = NamedSharding(mesh, P("grid"))
    out_shardings = dict.fromkeys(RATES, shard_g)
    if with_choices:
        out_shardings.update(dict.fromkeys(CHOICE_ARRAYS, NamedSharding(mesh, P(None, "grid"))))
    step = jax.jit(lambda qq, cc: _kernel(qq, cc, prep.closed, with_choices), out_shardings=out_shardings)
    parts: dict[str, list[np.ndarray]] = {k: [] for k in out_shardings}
    with bar(total=len(configs), desc="sweep", unit="cfg", disable=None if progress else True) as pbar:
        for start in range(0, len(configs), chunk):
            n = min(chunk, len(configs) - start)
            cfg = {k: jax.device_put(_pad(v[start:start + n], chunk), NamedSharding(mesh, P("grid", *[None] * (v.ndim - 1))))
                   for k, v in cfg_all.items()}
            for k, v in step(q, cfg).items():
                v = np.asarray(v)
                parts[k].append(v[:n] if v.ndim == 1 else v[:, :n].T)
            pbar.update(n)
    cat = {k: np.concatenate(v) if v else np.zeros(0) for k, v in parts.items()}
    return SweepResult(configs, *(cat[k] for k in RATES), *(cat.get(k) for k in CHOICE_ARRAYS),
                       devices=len(devices), chunk=chunk)


def _config_arrays(configs: list[Config], decision: np.ndarray, prior: np.ndarray, bar: np.ndarray,
                   k_n: int) -> dict[str, np.ndarray]:
    floats = lambda name: np.array([getattr(c, name) for c in configs], np.float32)  # noqa: E731
    return {
        "depth": np.array([c.ndocs or k_n for c in configs], np.int32),
        "w_rel": floats("w_rel"), "w_sup": floats("w_sup"), "w_use": floats("w_use"), "w_ret": floats("w_ret"),
        "seq_on": np.array([c.seqscore == "on" for c in configs], np.float32),
        "drop_irr": np.array([Hard(c.hard).drops_irrelevant for c in configs], bool),
        "drop_nosup": np.array([Hard(c.hard).drops_no_support for c in configs], bool),
        "refuse": np.array([c.refuse == "on" for c in configs], bool),
        "decision": decision, "prior": prior, "bar": bar,
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
    shares = gather_json({k: getattr(mine, k).tolist() for k in RATES})
    if me != 0:
        return None
    return SweepResult(configs, *(np.concatenate([np.asarray(s[k], np.float32) for s in shares]) for k in RATES),
                       devices=mine.devices * n_proc, chunk=mine.chunk)


def result_rows(result: SweepResult) -> list[dict[str, Any]]:
    return [{"config": i, **c.__dict__, **{k: float(getattr(result, k)[i]) for k in RATES}}
            for i, c in enumerate(result.configs)]


def to_json(obj) -> str:
    return json.dumps(obj, indent=1, default=float)
