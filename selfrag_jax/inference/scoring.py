"""Self-RAG's decisions and scores as plain numpy (docs/method.md section 5).

Everything here works on the small arrays the engine returns (or a `--cache` folder holds),
so `sweep` can re-rank without decoding. Group orders follow `selfrag_jax.tokens`:
Retrieve (No Retrieval, Retrieval, Continue), IsRel (Irrelevant, Relevant),
IsSup (Fully, Partially, No support), IsUse (Utility:1..5).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, replace

import numpy as np

from selfrag_jax.tokens import REFUSAL, UTILITY_WEIGHTS

MODES = ("adaptive", "always", "never", "hard")
THRESHOLD_RULES = ("paper", "released")
CLOSED_TASKS = ("fever", "pubhealth", "arc_c")
PIPELINES = ("selfrag", "naive", "top1", "none")  # Self-RAG and the baselines run in the same engine
NO_RET, RET = 0, 1  # indices in the Retrieve group
IRRELEVANT = 0  # index in the IsRel group
NO_SUPPORT = 2  # index in the IsSup group


@dataclass(frozen=True)
class RetrieveOptions:
    """When to retrieve. `threshold` is delta; the rule says which ratio it bounds."""

    mode: str = "adaptive"
    threshold: float = 0.2
    rule: str = "paper"  # paper: probabilities; released: raw log-probabilities

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r} is not one of {MODES}")
        if self.rule not in THRESHOLD_RULES:
            raise ValueError(f"threshold rule {self.rule!r} is not one of {THRESHOLD_RULES}")


class Hard(str, enum.Enum):
    """Hard constraints: candidates whose generated IsSup / IsRel token is dropped before choosing."""

    NONE = "none"
    NO_SUPPORT = "no_support"  # [No support / Contradictory]
    IRRELEVANT = "irrelevant"  # [Irrelevant]
    BOTH = "both"

    @classmethod
    def of(cls, no_support: bool, irrelevant: bool) -> "Hard":
        return {(False, False): cls.NONE, (True, False): cls.NO_SUPPORT, (False, True): cls.IRRELEVANT,
                (True, True): cls.BOTH}[bool(no_support), bool(irrelevant)]

    @property
    def drops_no_support(self) -> bool:
        return self in (Hard.NO_SUPPORT, Hard.BOTH)

    @property
    def drops_irrelevant(self) -> bool:
        return self in (Hard.IRRELEVANT, Hard.BOTH)


@dataclass(frozen=True)
class ScoreOptions:
    """Weights of the critique scores (paper: 1.0 / 1.0 / 0.5), whether exp(mean log-prob) is
    added (`seqscore`), and the hard constraints.

    `w_ret` (beyond the paper, 0 = the paper's score) adds the retriever's own probability of
    each passage, p(d|x) = softmax(score / `ret_temperature`) over the question's candidates,
    as RAG-Sequence weighs its passages. Where the critique tokens cannot tell passages apart
    the choice then falls back to the retriever's order instead of chance. 0.05 is the
    contrastive temperature MiniLM (scale 20) and Contriever were trained with."""

    w_rel: float = 1.0
    w_sup: float = 1.0
    w_use: float = 0.5
    seqscore: bool = True
    hard: Hard = Hard.NONE
    w_ret: float = 0.0
    ret_temperature: float = 0.05

    def __post_init__(self):
        try:
            object.__setattr__(self, "hard", Hard(self.hard))
        except ValueError:
            raise ValueError(f"hard constraint {self.hard!r} is not one of {[h.value for h in Hard]}") from None
        if not self.ret_temperature > 0:
            raise ValueError(f"ret_temperature must be positive, got {self.ret_temperature}")


@dataclass(frozen=True)
class RefuseOptions:
    """Honest refusal: answer only from a candidate that passes the support bar, else say
    `message`. The bar: the IsSup token the model chose is not `No support / Contradictory`,
    sup > `sup_threshold` and rel > `rel_threshold`; with `issup` off, rel > `rel_threshold`
    alone (for a generator whose IsSup does not tell stated from unstated values). And the
    retriever's score of the candidate's passage above `ret_threshold` (-inf: not consulted;
    a passage given without a score passes): a question about something the corpus does not
    hold finds only passages that score low, however relevant the model finds the closest
    one. Its scale is the index's, so a bar is chosen on dev data for one index. And the
    candidate's utility score (`use_score`, -1..1) above `use_threshold` (-inf: not consulted):
    an answer the passage states but to another question (a birth year where the birthplace
    was asked, the passage silent on it) is supported and relevant, and only IsUse says so.

    With a `combination` (a learned bar, chosen on dev data) the thresholds are not consulted:
    a candidate passes when its combined score is above 0 (`Combination`)."""

    enabled: bool = False
    rel_threshold: float = 0.5
    sup_threshold: float = 0.5
    message: str = REFUSAL
    issup: bool = True
    ret_threshold: float = float("-inf")
    use_threshold: float = float("-inf")
    combination: Combination | None = None

    def with_thresholds(self, **given) -> "RefuseOptions":
        """These options with the bar's thresholds (or `issup`) that are `given`: a bar given by
        its thresholds (a flag, a request's option) replaces a learned combination."""
        return replace(self, **given, combination=None) if given else self


# What a learned bar weighs, per candidate: IsRel's log-odds, the retriever's score, the utility
# and support scores, the answer's mean log-probability, the question's Retrieve log-odds, and
# how much of the question the passage mentions (`coverage`).
BAR_FEATURES = ("logit_rel", "ret_score", "use", "sup", "seq", "logit_retrieve", "name_cover", "word_cover")

# Words a question is asked with, not about (`coverage` skips them).
QUESTION_WORDS = frozenset(
    "what who whom whose when where which why how is are was were do does did a an the of in on at to for from by with "
    "and or as that this it its name tell me please".split())


def coverage(question: str, passage: dict | None) -> tuple[float, float]:
    """(names, words): the share of the question's capitalised words (the names it asks about)
    and of all its words, question words aside, that the passage's title or text contains
    (case-insensitive, a possessive 's dropped); NaN without a passage or without such words
    (a question typed in lower case: unknown, not covered). A passage about a look-alike shares
    only part of the name; one silent on what is asked lacks its word. Retrievers and IsRel
    score both close to a real match."""
    if passage is None:
        return float("nan"), float("nan")
    words = lambda text: [w.removesuffix("'s") for w in re.findall(r"[\w']+", text)]  # noqa: E731
    found = {w.lower() for w in words(f"{passage.get('title') or ''} {passage.get('text') or ''}")}
    asked = [w for w in words(question) if w.lower() not in QUESTION_WORDS]
    share = lambda ws: float(np.mean([w.lower() in found for w in ws])) if ws else float("nan")  # noqa: E731
    return share([w for w in asked if w[:1].isupper()]), share(asked)


@dataclass(frozen=True)
class Combination:
    """A refusal bar that weighs the signals together: a candidate passes when
    bias + sum of weight * (feature - center) over BAR_FEATURES is above 0. Thresholds on each
    signal alone cannot trade one against another: an answer to a question no passage answers
    is relevant and retrieved well but rated unhelpful, one about a look-alike is rated helpful
    but retrieved less well. A feature a candidate lacks (a passage given without a retriever
    score, a cache written before `coverage`) sits at the center."""

    weights: tuple[float, ...]
    centers: tuple[float, ...]
    bias: float

    def __post_init__(self):
        if not len(self.weights) == len(self.centers) == len(BAR_FEATURES):
            raise ValueError(f"a combination has {len(BAR_FEATURES)} weights and centers ({', '.join(BAR_FEATURES)})")

    def score(self, features: np.ndarray) -> np.ndarray:
        """[C] combined scores of [C, F] `bar_features`."""
        centered = np.nan_to_num(np.asarray(features, np.float64) - np.asarray(self.centers))  # NaN: at the center
        return centered @ np.asarray(self.weights, np.float64) + self.bias

    def to_json(self) -> dict:
        return {"bias": self.bias, "weights": dict(zip(BAR_FEATURES, self.weights)),
                "centers": dict(zip(BAR_FEATURES, self.centers))}

    @classmethod
    def from_json(cls, obj) -> "Combination":
        """From `to_json`'s form; a ValueError names what is missing or not a number."""
        try:
            parts = [[obj[part][f] for f in BAR_FEATURES] for part in ("weights", "centers")] + [[obj["bias"]]]
        except (TypeError, KeyError) as err:
            raise ValueError(f"a combination needs 'bias' and 'weights' and 'centers' of {', '.join(BAR_FEATURES)}: "
                             f"missing {err}") from None
        values = [v for part in parts for v in part]
        if any(isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v) for v in values):
            raise ValueError(f"a combination's weights, centers and bias must be finite numbers, got {obj!r}")
        return cls(tuple(map(float, parts[0])), tuple(map(float, parts[1])), float(parts[2][0]))


def bar_features(rel, sup, use, ret_score, seq, retrieve_logprobs, name_cover, word_cover) -> np.ndarray:
    """[C, F] BAR_FEATURES of candidates: scores as `candidate_scores` gives them, `seq` the mean
    log-probability, `retrieve_logprobs` [C, 3] their question's, the two `coverage` shares.
    Probabilities are clipped to 1e-6 from 0 and 1 before their log-odds, and seq below -10 (one
    token rated impossible would otherwise outweigh everything)."""
    logit = lambda p: np.log(p / (1 - p))  # noqa: E731
    rel = np.clip(np.asarray(rel, np.float64), 1e-6, 1 - 1e-6)
    ratio = np.clip(paper_ratio(retrieve_logprobs), 1e-6, 1 - 1e-6)
    return np.stack([logit(rel), *(np.asarray(x, np.float64) for x in (ret_score, use, sup)),
                     np.maximum(np.asarray(seq, np.float64), -10.0), logit(ratio),
                     *(np.asarray(x, np.float64) for x in (name_cover, word_cover))], -1)


# --- retrieval decision -----------------------------------------------------------------
def paper_ratio(retrieve_logprobs: np.ndarray) -> np.ndarray:
    """p(Retrieval) / (p(Retrieval) + p(No Retrieval)) from the full softmax."""
    p = np.exp(np.asarray(retrieve_logprobs, np.float64))
    return p[..., RET] / np.maximum(p[..., RET] + p[..., NO_RET], 1e-300)


def released_ratio(retrieve_logprobs: np.ndarray) -> np.ndarray:
    """The released short-form script's ratio on raw log-probabilities: lp_R / (lp_R + lp_N)."""
    lp = np.asarray(retrieve_logprobs, np.float64)
    denom = lp[..., RET] + lp[..., NO_RET]
    return np.where(denom != 0, lp[..., RET] / np.where(denom != 0, denom, 1.0), 0.0)


def decide_retrieve(retrieve_logprobs: np.ndarray, greedy_retrieval: np.ndarray, opts: RetrieveOptions) -> np.ndarray:
    """Bool per context: retrieve here? (`greedy_retrieval`: the argmax token is [Retrieval].)"""
    n = np.shape(greedy_retrieval)
    if opts.mode == "always":
        return np.ones(n, bool)
    if opts.mode == "never":
        return np.zeros(n, bool)
    if opts.mode == "hard":
        return np.asarray(greedy_retrieval, bool)
    ratio = paper_ratio(retrieve_logprobs) if opts.rule == "paper" else released_ratio(retrieve_logprobs)
    return ratio > opts.threshold


# --- candidate scores ---------------------------------------------------------------
def rel_score(rel_probs: np.ndarray) -> np.ndarray:
    p = np.asarray(rel_probs, np.float64)
    return p[..., 1] / np.maximum(p.sum(-1), 1e-300)


def sup_score(sup_probs: np.ndarray, found: np.ndarray) -> np.ndarray:
    p = np.asarray(sup_probs, np.float64)
    return np.where(found, (p[..., 0] + 0.5 * p[..., 1]) / np.maximum(p.sum(-1), 1e-300), 0.0)


def use_score(use_probs: np.ndarray, found: np.ndarray) -> np.ndarray:
    p = np.asarray(use_probs, np.float64)
    return np.where(found, (p @ np.asarray(UTILITY_WEIGHTS)) / np.maximum(p.sum(-1), 1e-300), 0.0)


def passage_score(psg: dict | None) -> float:
    """The retriever's score a candidate's passage carries (`items.passage`), NaN if none."""
    return float((psg or {}).get("score", np.nan))


def retriever_prob(scores, temperature: float) -> np.ndarray:
    """p(d|x) over one question's candidates: softmax(score / temperature). All zeros when
    any candidate has no finite retriever score (NaN: `ctxs` without one), so the prior never
    favours the candidates that happen to carry a score."""
    s = np.asarray(scores, np.float64)
    if s.size == 0 or not np.isfinite(s).all():
        return np.zeros(s.shape)
    e = np.exp((s - s.max()) / temperature)
    return e / e.sum()


def combine(seq_exp, rel, sup, use, ret, seq_on, w_rel, w_sup, w_use, w_ret):
    """The final score's formula, for numpy or jax.numpy arrays that broadcast (the sweep passes
    a grid of weights on the last axis): exp(seq) (if on) + w_rel rel + w_sup sup + w_use use + w_ret ret."""
    return seq_exp * seq_on + w_rel * rel + w_sup * sup + w_use * use + w_ret * ret


def final_score(seq: np.ndarray, rel: np.ndarray, sup: np.ndarray, use: np.ndarray, opts: ScoreOptions,
                ret: np.ndarray | float = 0.0) -> np.ndarray:
    """Self-RAG's candidate score; `ret` is `retriever_prob`, weighted by opts.w_ret (0: the paper's score)."""
    return combine(np.exp(np.asarray(seq, np.float64)), np.asarray(rel, np.float64), np.asarray(sup, np.float64),
                   np.asarray(use, np.float64), np.asarray(ret, np.float64), float(opts.seqscore),
                   opts.w_rel, opts.w_sup, opts.w_use, opts.w_ret)


def passes_bar(rel: np.ndarray, sup: np.ndarray, use: np.ndarray, sup_label: np.ndarray, ret_score: np.ndarray,
               opts: RefuseOptions, features: np.ndarray | None = None) -> np.ndarray:
    """Bool per candidate: is its answer supported well enough to be given? A `combination`
    reads the candidates' [C, F] `bar_features` instead."""
    if opts.combination is not None:
        if features is None:
            raise ValueError("a combined refusal bar needs the candidates' bar_features")
        return opts.combination.score(features) > 0
    ret_score = np.asarray(ret_score, np.float64)
    passes = (np.asarray(rel) > opts.rel_threshold) & (np.isnan(ret_score) | (ret_score > opts.ret_threshold)) \
        & (np.asarray(use) > opts.use_threshold)
    if not opts.issup:
        return passes
    sup_label = np.asarray(sup_label)
    return (sup_label >= 0) & (sup_label != NO_SUPPORT) & (np.asarray(sup) > opts.sup_threshold) & passes


def refusal_reason(rel: np.ndarray, sup: np.ndarray, use: np.ndarray, sup_label: np.ndarray, ret_score: np.ndarray,
                   opts: RefuseOptions) -> str:
    """Why no candidate passed the bar, naming the first test that every candidate failed
    (or, when each failed a different one, that no single candidate passed them all)."""
    rel, sup, use, sup_label = np.asarray(rel), np.asarray(sup), np.asarray(use), np.asarray(sup_label)
    ret = np.asarray(ret_score, np.float64)
    if rel.size == 0:
        return "no passages were found"
    if opts.combination is not None:
        return "no answer passed the learned bar (relevance, retrieval, utility, support, confidence and coverage)"
    if not (np.isnan(ret) | (ret > opts.ret_threshold)).any():
        return f"every passage scored low by the retriever (max {np.nanmax(ret):.3f} <= {opts.ret_threshold})"
    if not (rel > opts.rel_threshold).any():
        return f"every passage judged irrelevant (max rel {rel.max():.3f} <= {opts.rel_threshold})"
    if not (use > opts.use_threshold).any():
        return f"every answer judged unhelpful (max use {use.max():.3f} <= {opts.use_threshold})"
    if not opts.issup:
        return "no candidate passed the bar"
    judged = (sup_label >= 0) & (sup_label != NO_SUPPORT)
    if not judged.any():
        return "no candidate judged supported (IsSup: No support / Contradictory, or none generated)"
    if not (sup > opts.sup_threshold).any():
        return f"support too weak (max sup {sup.max():.3f} <= {opts.sup_threshold})"
    return "no candidate is both relevant and supported"


# --- closed-set answers -----------------------------------------------------------------
def answer_group(text: str, task: str = "open") -> str:
    """The form closed-set aggregation groups by (and `--cache` stores)."""
    t = " ".join(text.strip().split()).lower()
    if task in ("fever", "pubhealth"):
        t = t.replace("supports", "true").replace("refutes", "false")
        for label in ("true", "false"):
            if re.search(rf"\b{label}\b", t):
                return label
    if task == "arc_c":
        m = re.match(r"^\(?([a-e])\b", t)
        if m:
            return m.group(1).upper()
    return t.rstrip(" .!?")
