"""`conductor fit PROFILE... -o params.json`: fit the predictors offline and write their params.

Also runnable as `python -m predictors.cli`. Prints each model's fit quality so a bad profile is
seen at once; exits 2 on a profile that cannot be fitted.
"""

from __future__ import annotations

import argparse
import sys

from conductor.core.cli_help import DefaultsHelpFormatter
from predictors.params import DecodePrior
from predictors.profile import ProfileError, bundled_profile, fit_profiles


def _parser() -> argparse.ArgumentParser:
    prior = DecodePrior()
    p = argparse.ArgumentParser(
        prog="conductor fit",
        description="Fit Conductor's latency predictors from profile CSVs.",
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument("profiles", nargs="*", help=f"profile CSV files (default: the bundled {bundled_profile().name})")
    p.add_argument("-o", "--output", required=True, help="where to write the params JSON")
    p.add_argument("--kv-bytes-per-token", type=float, default=None, help="override the profile's KV size per token")
    p.add_argument("--weight-bytes", type=float, default=prior.weight_bytes, help="TBT prior: model weight bytes")
    p.add_argument("--hbm-bytes-per-s", type=float, default=prior.hbm_bytes_per_s, help="TBT prior: HBM bandwidth")
    return p


def fit_main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    profiles = args.profiles or [str(bundled_profile())]
    prior = DecodePrior(weight_bytes=args.weight_bytes, hbm_bytes_per_s=args.hbm_bytes_per_s)
    try:
        params = fit_profiles(profiles, kv_bytes=args.kv_bytes_per_token, decode_prior=prior)
    except ProfileError as exc:
        print(f"conductor fit: {exc}", file=sys.stderr)
        return 2
    params.save(args.output)
    c0, c1, c2 = params.prefill.coef
    print(
        f"prefill: t = {c0 * 1e3:.3f} ms + {c1 * 1e6:.4f} us*new + {c2 * 1e9:.5f} ns*new*(new+2*cached)"
        f"  MAPE {params.prefill.mape:.2%}  p90 x{params.prefill.p90_ratio:.3f}  ({params.prefill.samples} rows)"
    )
    for link, m in params.transfer.items():
        bw = 1.0 / m.coef[1] if m.coef[1] > 0 else float("inf")
        print(f"transfer[{link}]: {m.coef[0] * 1e3:.3f} ms + bytes / {bw / 1e9:.2f} GB/s  MAPE {m.mape:.2%}")
    d0, d1, d2 = params.tbt.coef
    kind = "fitted" if params.tbt.samples else "prior"
    print(f"tbt ({kind}): {d0 * 1e3:.3f} ms + {d1 * 1e6:.2f} us*batch + {d2 * 1e9:.4f} ns*resident_kv")
    print(f"kv bytes per token: {params.kv_bytes_per_token:.0f}; wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(fit_main())
