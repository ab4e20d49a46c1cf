"""Serving plans: `python -m bench.bench_plan_serve`.

Each serving config under `configs/serve/` is planned on the target its name gives
(`selfrag-jax plan configs/serve/X.yaml --mesh TARGET`): the engine's own prefill and decode
programs AOT-compiled through libtpu for TPUs (an analytic estimate for GPUs), bytes per
chip, and the largest question batch that fits. One oversized batch (the 7B on v5e-8 asked
for 512 questions) shows a plan that does not fit, reported with the batch that does.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from bench.common import machine_info, now, versions, write_result

ROOT = Path(__file__).resolve().parents[1]
OVERSIZED = ("selfrag_7b_v5e-8", ["serve.questions=512"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args(argv)
    import jax

    from selfrag_jax.chips import GiB
    from selfrag_jax.plan import plan_serve

    jax.config.update("jax_default_matmul_precision", None)
    cases = [(p.stem, []) for p in sorted((ROOT / "configs" / "serve").glob("*.yaml"))] + [OVERSIZED]
    reports, summary = {}, []
    for name, overrides in cases:
        target = name.rsplit("_", 1)[1]
        p = plan_serve(str(ROOT / "configs" / "serve" / f"{name}.yaml"), target, overrides)
        p.config = f"configs/serve/{name}.yaml"  # the repository's path, not this machine's
        key = name + ("_oversized" if overrides else "")
        reports[key] = {**dataclasses.asdict(p), "fits": p.fits, "overrides": overrides}
        decode = p.programs["decode"]
        bound = "at least " if all(p.tried.values()) else ""
        print(f"{key}: decode {decode.total / GiB:.2f} GiB per chip of {decode.hbm / GiB:.0f}, "
              f"{'fits' if p.fits else 'does not fit'}; largest question batch {bound}{p.largest_questions}", flush=True)
        summary.append({"what": f"plan {key}: decode per chip ({p.serve['questions']} questions x {p.serve['ndocs']})"
                                + (" (estimate)" if decode.estimated else ""),
                        "ours": f"{decode.total / GiB:.2f} GiB", "peer": f"{decode.hbm / GiB:.0f} GiB HBM",
                        "ratio": None, "goal": "does not fit" if overrides else "fits",
                        "met": (not p.fits and p.largest_questions >= 1) if overrides else p.fits})
    write_result("plan_serve", {"date": now(), "machine": machine_info(), "versions": versions("flax", "libtpu"),
                                "reports": reports, "summary": summary})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
