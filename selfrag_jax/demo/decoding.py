"""The demo's decoding helpers: a models folder's engine, the world's eval items, batches with
progress, and Self-RAG's retrieval depth chosen for a generator on the dev split."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from selfrag_jax.inference.settings import SETTINGS_FILE

# Self-RAG's retrieval depth K (the paper: 5 or 10) is chosen per set of models on the dev
# split and kept beside them (`decoding.json`, `choose_depth`): the paper's score chooses
# among the retriever's top K, and a critic that cannot match names (the reduced retrain's)
# chooses better among fewer look-alikes. Without the file: the paper's 5.
PAPER_NDOCS = 5


def model_ndocs(models: Path) -> tuple[int, dict[str, Any] | None]:
    """The depth chosen on the dev split for these models (`SETTINGS_FILE`), else the paper's."""
    path = models / SETTINGS_FILE
    if not path.exists():
        return PAPER_NDOCS, None
    info = json.loads(path.read_text())
    ndocs = info.get("ndocs")
    if not isinstance(ndocs, int) or not 1 <= ndocs <= PAPER_NDOCS:
        raise ValueError(f"{path}: ndocs must be a whole number from 1 to {PAPER_NDOCS}, got {ndocs!r}")
    return ndocs, info


def choose_depth(generator: Path, world: Path, index: Path, cache: Path, n: int = 300, batch_size: int = 32,
                 log=print) -> dict[str, Any]:
    """Self-RAG's retrieval depth for this generator: decode the first `n` dev questions
    (eval/world_qa_dev.jsonl, the held-out people's other attributes) once with the paper's
    top-5 and both paths (`generate --cache`, written to `cache`), then `sweep` K = 1..5 under
    the paper's score and retrieval rule. The best dev match wins, ties going to the deeper K
    (the paper's side)."""
    from selfrag_jax.evaluation import sweep as S
    from selfrag_jax.inference.cache import write_cache
    from selfrag_jax.inference.selfrag import GenerateOptions, ShortForm
    from selfrag_jax.retrieval.retriever import Retriever

    engine, tok = load_engine(generator)
    items = load_items(world / "eval" / "world_qa_dev.jsonl", n)
    runner = ShortForm(engine, tok, GenerateOptions(task="open", ndocs=PAPER_NDOCS, keep_both_paths=True),
                       Retriever.from_dir(index).retrieve)
    results = run_batches(runner, items, batch_size, "dev/depth")
    depths = list(range(1, PAPER_NDOCS + 1))
    result = S.run_sweep(S.prepare(write_cache(cache, results, runner.opts)), [S.Config(ndocs=k) for k in depths])
    dev = {str(k): round(float(m), 4) for k, m in zip(depths, result.metric)}
    best = max(depths, key=lambda k: (dev[str(k)], k))
    log(f"[depth] dev match by K (n={len(items)}): " + ", ".join(f"{k}: {v:.3f}" for k, v in dev.items())
        + f" -> K = {best}")
    return {"ndocs": best, "dev_match": dev, "n": len(items), "split": "world_qa_dev",
            "sweep_config": dataclasses.asdict(result.configs[best - 1])}


# The refusal bar is chosen on the dev splits: the bar (IsRel over rel, IsSup over sup, the
# retriever's score over a floor, IsUse's utility score over REFUSE_USE; every candidate below
# it and the answer is "I don't know.") that refuses the most of the kind of unanswerable
# question it refuses least, while answerable dev accuracy stays within MAX_DEV_DROP of
# Self-RAG without refusal (the goal on test is 5 points; the rest is margin). Retriever floors
# are read off the answerable dev questions' best passage scores (these percentiles), since
# their scale is the index's.
REFUSE_REL = (0.5, 0.7, 0.8, 0.9, 0.95, 0.97, 0.98, 0.99, 0.995, 0.998, 0.999)
REFUSE_SUP = (0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99)
REFUSE_RET_PERCENTILES = (1, 2, 5, 10, 15)
REFUSE_USE = (float("-inf"), -0.5, 0.0, 0.25, 0.5, 0.75)  # use_score's scale: -1 ([Utility:1]) to 1 ([Utility:5])
MAX_DEV_DROP = 0.03


def within(answerable, no_refusal: float, max_drop: float = MAX_DEV_DROP):
    """Answerable dev accuracy (a number or an array of them) within `max_drop` of Self-RAG
    without refusal."""
    return answerable >= no_refusal - max_drop - 1e-9


def _kinds_key(dev: dict[str, float]) -> tuple[float, float]:
    """pick_refusal's order of bars within the window: the least-refused kind, then the mean."""
    rates = [v for k, v in dev.items() if k != "answerable"]
    return round(min(rates), 6), round(float(np.mean(rates)), 6)


def pick_refusal(bars: list[tuple[float, float, bool, float, float]], answerable: np.ndarray,
                 refused: dict[str, np.ndarray], no_refusal: float, max_drop: float = MAX_DEV_DROP) -> int:
    """Index of the bar (rel, sup, issup, ret, use) to keep: among those whose answerable
    accuracy is within `max_drop` of `no_refusal`, the highest refusal rate on the least-refused
    kind, then on average, then the lower bars (fewer answers withheld), then one that consults
    IsSup. With none within reach, the most accurate bar."""
    ok = np.flatnonzero(within(answerable, no_refusal, max_drop))
    if not len(ok):
        return int(np.argmax(answerable))
    rates = lambda i: {k: float(v[i]) for k, v in refused.items()}  # noqa: E731
    return int(max(ok, key=lambda i: (*_kinds_key(rates(i)), -bars[i][0], -bars[i][1], -bars[i][3], -bars[i][4],
                                      bars[i][2])))


def retriever_floors(table, ndocs: int) -> list[float]:
    """Retriever-score bars to try: no floor, and the REFUSE_RET_PERCENTILES of the answerable
    questions' best scores among their first `ndocs` passages (`table`: their candidates)."""
    best = [np.nanmax(table.ret_score[table.rows(q, ndocs)], initial=-np.inf) for q in range(table.n_questions)]
    best = np.asarray(best, np.float64)
    best = best[np.isfinite(best)]
    floors = sorted({round(float(x), 4) for x in np.percentile(best, REFUSE_RET_PERCENTILES)}) if len(best) else []
    return [float("-inf"), *floors]


# A learned bar (`scoring.Combination`) is tried beside the grid: logistic regression of "a right
# answer to an answerable question" on the dev candidates' BAR_FEATURES (each set weighing the
# same), then a seeded hill climb of the weights on pick_refusal's own objective, each weight
# vector at its best threshold. It is kept when it beats the grid's best bar on that objective.
COMBINATION_SEARCH_STEPS = 1500


@dataclass
class DevSet:
    """One dev set's candidates within the depth, as [Q, K] arrays, for scoring many bars at once."""

    features: np.ndarray  # [Q, K, F] BAR_FEATURES
    final: np.ndarray  # [Q, K] the paper's score, -inf past the question's candidates
    match: np.ndarray  # [Q, K]
    valid: np.ndarray  # [Q, K] a candidate within the depth
    decided: np.ndarray  # [Q] retrieval decided (without candidates: refused)
    match_nr: np.ndarray  # [Q] the no-retrieval answer's match
    match_refusal: np.ndarray  # [Q] the refusal's match

    @classmethod
    def of(cls, prep, ndocs: int) -> "DevSet":
        """From a `sweep.prepare`d cache, under the sweep's default options at depth `ndocs`."""
        from selfrag_jax.evaluation import sweep as S
        from selfrag_jax.inference import scoring
        from selfrag_jax.inference.candidates import bar_features

        t, parts, opts = prep.table, prep.parts, S.Config(ndocs=ndocs).options(prep.cache.task)
        features = bar_features(t, parts)
        valid = prep.valid & (np.arange(t.width)[None, :] < ndocs)
        decided = scoring.decide_retrieve(t.retrieve_logprobs, t.greedy_retrieval, opts.retrieve)
        final = parts["final"]  # the paper's score under the sweep's defaults (no retriever prior)
        return cls(t.padded(features, 0.0), np.where(valid, t.padded(final, 0.0), -np.inf), prep.match, valid,
                   decided, prep.match_nr, prep.match_refusal)

    def metric(self, scores: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
        """[T] mean match when candidates pass with `scores` [Q, K] above each threshold: the
        open-task choice (`candidates.choose`: the best passing candidate by the paper's score,
        the first on ties; none: the refusal; retrieval not decided: the no-retrieval answer)."""
        passing = self.valid[None] & (scores[None] > thresholds[:, None, None])  # [T, Q, K]
        best = np.argmax(np.where(passing, self.final[None], -np.inf), axis=-1)
        given = np.take_along_axis(np.broadcast_to(self.match, passing.shape), best[..., None], -1)[..., 0]
        answered = np.where(passing.any(-1), given, self.match_refusal[None])
        return np.where(self.decided[None], answered, self.match_nr[None]).mean(-1)


def fit_combination(sets: dict[str, DevSet], no_refusal: float, max_drop: float = MAX_DEV_DROP,
                    steps: int = COMBINATION_SEARCH_STEPS, seed: int = 0):
    """(Combination, its dev metric per set) that refuses the most of the least-refused
    unanswerable kind with "answerable" within `max_drop` of `no_refusal` (pick_refusal's
    objective), or None when no weights reach the window."""
    from selfrag_jax.inference.scoring import Combination

    real = {k: s.valid for k, s in sets.items()}
    x = np.concatenate([s.features[real[k]] for k, s in sets.items()])
    known = np.isfinite(x).any(0)  # a feature no candidate has (NaN: an old cache) weighs nothing
    center = np.where(known, np.nanmean(np.where(known, x, 0.0), 0), 0.0)
    scale = np.where(known, np.nanstd(np.where(known, x, 0.0), 0), 1.0) + 1e-9
    standard = {k: np.nan_to_num((s.features - center) / scale) for k, s in sets.items()}  # NaN: at the center
    x = np.nan_to_num((x - center) / scale)
    kinds = [k for k in sets if k != "answerable"]

    def evaluate(beta):  # (objective, threshold, metric per set) at this weight vector's best threshold
        scores = {k: standard[k] @ beta for k in sets}
        thresholds = np.quantile(np.concatenate([scores[k][real[k]] for k in sets]), np.linspace(0, 0.995, 400))
        metric = {k: sets[k].metric(scores[k], thresholds) for k in sets}
        ok = within(metric["answerable"], no_refusal, max_drop)
        rates = np.stack([metric[k] for k in kinds])
        objective = np.where(ok, 2 + rates.min(0) + rates.mean(0) / 100, metric["answerable"])
        i = int(np.argmax(objective))
        return objective[i], thresholds[i], {k: float(m[i]) for k, m in metric.items()}

    # Logistic regression (Newton's method, a little L2) as the starting point.
    y = np.concatenate([sets[k].match[real[k]] if k == "answerable" else np.zeros(real[k].sum()) for k in sets])
    w = np.concatenate([np.full(real[k].sum(), (len(kinds) if k == "answerable" else 1) / real[k].sum()) for k in sets])
    xs = np.concatenate([x, np.ones((len(x), 1))], 1)  # and an intercept
    beta, ridge = np.zeros(xs.shape[1]), 1e-2 * np.diag([1.0] * (xs.shape[1] - 1) + [0.0])
    for _ in range(50):
        p = 1 / (1 + np.exp(-(xs @ beta)))
        beta -= np.linalg.solve((xs * (w * p * (1 - p))[:, None]).T @ xs + ridge, xs.T @ (w * (p - y)) + ridge @ beta)
    beta = beta[:-1]  # the threshold takes the intercept's place
    rng = np.random.default_rng(seed)
    best = (*evaluate(beta), beta)
    for _ in range(steps):
        trial = best[3] + rng.normal(0, 0.3, beta.shape) * (rng.random(beta.shape) < 0.5)
        found = evaluate(trial)
        if found[0] > best[0]:
            best = (*found, trial)
    objective, threshold, metric, beta = best
    if objective < 2:
        return None
    weights = beta / scale  # the threshold moves into the bias: pass when the score is above 0
    return Combination(tuple(map(float, weights)), tuple(map(float, center)), -float(threshold)), metric


def choose_refusal(generator: Path, world: Path, index: Path, cache: Path, ndocs: int, n_answerable: int = 300,
                   batch_size: int = 32, answerable_cache: Path | None = None, log=print) -> dict[str, Any]:
    """The refusal bar for this generator (`pick_refusal`), from one decode of the dev splits:
    the first `n_answerable` of world_qa_dev (or `answerable_cache`, a cache of them with both
    paths at a depth of at least `ndocs`: `choose_depth`'s) and every unanswerable kind's dev
    split (eval/unanswerable/*_dev.jsonl), each cached with both paths and swept at depth
    `ndocs` over REFUSE_REL x REFUSE_SUP (and IsRel alone) x `retriever_floors` x REFUSE_USE,
    and a learned combination (`fit_combination`) kept where it does better. An unanswerable
    question counts as refused when the answer is the refusal, from the bar or written by the
    generator (its gold is set to that message)."""
    from selfrag_jax.inference.cache import load_cache, write_cache
    from selfrag_jax.inference.scoring import RefuseOptions
    from selfrag_jax.inference.selfrag import GenerateOptions, ShortForm
    from selfrag_jax.retrieval.retriever import Retriever

    engine, tok = load_engine(generator)
    message = RefuseOptions().message
    runner = ShortForm(engine, tok, GenerateOptions(task="open", ndocs=ndocs, keep_both_paths=True),
                       Retriever.from_dir(index).retrieve)
    sets = {"answerable": world / "eval" / "world_qa_dev.jsonl"}
    sets.update({p.name.removesuffix("_dev.jsonl"): p for p in sorted((world / "eval" / "unanswerable").glob("*_dev.jsonl"))})
    if len(sets) == 1:
        raise FileNotFoundError(f"{world / 'eval' / 'unanswerable'}: no *_dev.jsonl sets (a world built before them)")
    caches = {}
    for name, path in sets.items():
        if name == "answerable" and answerable_cache is not None:
            caches[name] = load_cache(answerable_cache)
            continue
        items = load_items(path, n_answerable if name == "answerable" else None)
        if name != "answerable":  # counted as matched when the answer is the refusal
            items = [dataclasses.replace(it, record={**it.record, "answers": [message]}) for it in items]
        caches[name] = write_cache(cache / name, run_batches(runner, items, batch_size, f"dev/refusal {name}"), runner.opts)
    return pick_refusal_on(caches, ndocs, log)


def pick_refusal_on(caches: dict[str, Any], ndocs: int, log=print) -> dict[str, Any]:
    """`choose_refusal`'s choice over cached dev decodes: "answerable" and each unanswerable
    kind (whose gold answer is the refusal message), swept at depth `ndocs`."""
    from selfrag_jax.evaluation import sweep as S

    # with IsSup consulted at each sup threshold, and IsRel alone (IsSup may not mean support)
    prepared = {name: S.prepare(cached) for name, cached in caches.items()}
    bars = [(r, s, i, f, u) for u in REFUSE_USE for f in retriever_floors(prepared["answerable"].table, ndocs)
            for r, s, i in [(r, s, True) for r in REFUSE_REL for s in REFUSE_SUP] + [(r, 0.0, False) for r in REFUSE_REL]]
    configs = [S.Config(ndocs=ndocs, refuse="off")] + [
        S.Config(ndocs=ndocs, refuse="on", refuse_rel_threshold=r, refuse_sup_threshold=s, refuse_issup=S.ON_OFF[not i],
                 refuse_ret_threshold=f, refuse_use_threshold=u) for r, s, i, f, u in bars]
    metric = {name: S.run_sweep(prep, configs).metric for name, prep in prepared.items()}
    n = {name: len(cached.questions) for name, cached in caches.items()}
    refused = {k: v[1:] for k, v in metric.items() if k != "answerable"}
    best = pick_refusal(bars, metric["answerable"][1:], refused, float(metric["answerable"][0]))
    rel, sup, issup, floor, use = bars[best]
    chosen = grid_best = {"answerable": round(float(metric["answerable"][1 + best]), 4),
                          **{k: round(float(v[best]), 4) for k, v in refused.items()}}
    no_refusal = float(metric["answerable"][0])
    learned = fit_combination({name: DevSet.of(prep, ndocs) for name, prep in prepared.items()}, no_refusal)
    combination = None
    if learned is not None and within(learned[1]["answerable"], no_refusal) and (
            not within(grid_best["answerable"], no_refusal) or _kinds_key(learned[1]) > _kinds_key(grid_best)):
        combination, chosen = learned[0], {k: round(v, 4) for k, v in learned[1].items()}
    log(f"[refusal] dev, no refusal: answerable {metric['answerable'][0]:.3f}, refused "
        + ", ".join(f"{k} {v[0]:.3f}" for k, v in metric.items() if k != "answerable")
        + ("; the learned combination" if combination else
           f"; bar rel > {rel}" + (f", sup > {sup}" if issup else ", IsSup not consulted")
           + (f", retriever score > {floor}" if np.isfinite(floor) else "")
           + (f", utility > {use}" if np.isfinite(use) else "")) + ": "
        + ", ".join(f"{k} {v:.3f}" for k, v in chosen.items()))
    finite = lambda f: float(f) if np.isfinite(f) else None  # noqa: E731  (JSON has no -inf: null)
    return {"rel_threshold": rel, "sup_threshold": sup, "issup": issup, "ret_threshold": finite(floor),
            "use_threshold": finite(use), "combination": combination.to_json() if combination else None,
            "grid_best_dev": grid_best,
            "ndocs": ndocs,
            "max_dev_drop": MAX_DEV_DROP, "dev": chosen, "dev_no_refusal": {k: round(float(v[0]), 4) for k, v in metric.items()},
            "n": n,
            # every bar tried, as columns (thousands of bars: a list of rows would fill the file)
            "dev_grid": {"rel": [b[0] for b in bars], "sup": [b[1] for b in bars], "issup": [b[2] for b in bars],
                         "ret": [finite(b[3]) for b in bars], "use": [finite(b[4]) for b in bars],
                         "answerable": [round(float(x), 4) for x in metric["answerable"][1:]],
                         "min_refused": [round(float(x), 4) for x in np.min(list(refused.values()), axis=0)],
                         "mean_refused": [round(float(x), 4) for x in np.mean(list(refused.values()), axis=0)]}}


def load_engine(generator: Path, max_new_tokens: int = 24, mesh: str | None = None, dtype: str = "float32"):
    """(the compiled engine, tokenizer) of a generator folder or run, on `mesh` in `dtype`."""
    from selfrag_jax.inference.engine import Engine

    return Engine.load(str(generator), max_new_tokens, mesh, dtype)


def run_batches(runner, items: list, batch_size: int, desc: str) -> list:
    """`runner.run` over `items` in batches, with a progress bar."""
    from selfrag_jax.utils import progress

    results = []
    for start in progress(range(0, len(items), batch_size), desc=desc, unit="batch"):
        results += runner.run(items[start:start + batch_size])
    return results


def load_items(path: Path, limit: int | None):
    from selfrag_jax.inference.items import Item

    items = []
    for line in path.read_text().splitlines()[:limit]:
        rec = json.loads(line)
        items.append(Item(rec["id"], rec["question"], rec.get("instruction") or rec["question"], "", None, rec,
                          f"{path.name}:{len(items) + 1}"))
    return items
