"""The smooth η of one sub-model: a bounded sigmoid of a quadratic in device-normalized log-features.

Each (family, variant) is fitted as

    latency_s ≈ roof_s / η(features) + overhead_s

with η of the :class:`~kernelsight.simcore.eta.LogPolyEta` form. The loss is the squared log-ratio of predicted
to measured latency — i.e. relative error, what MAPE judges — minimized by Levenberg–Marquardt with a small ridge
on the polynomial terms (keeps extrapolation tame). Duplicate measurements are simply more samples. The spec
constants the basis divides by (:func:`device_constants`) are what lets the coefficients transfer to another GPU.
"""

from __future__ import annotations

import numpy as np

from kernelsight.simcore import kernels as K
from kernelsight.simcore.eta import LogPolyEta
from kernelsight.simcore.eta_basis import basis_matrix, quadratic_design
from kernelsight.simcore.fp4_dispatch import NVFP4, NVFP4_BYTES_PER_ELEMENT
from kernelsight.simcore.hardware import HardwareSpec

#: Bounds of the fitted η sigmoid.
ETA_LO, ETA_HI = 0.01, 1.5
#: Ridge on the polynomial terms of a full-complexity fit.
RIDGE = 1e-3


# ------------------------------------------------------------------------------------------------
# device constants the bases normalize by
# ------------------------------------------------------------------------------------------------
def device_constants(family: str, variant: str, hw: HardwareSpec) -> dict[str, float]:
    """Spec numbers a family's basis divides by: machine balance of the variant's dtype, SMs, L2."""
    dev = {"num_sms": float(hw.num_sms), "l2_bytes": float(hw.l2_bytes)}
    if family == "gemm":
        code = int(float(variant))
        fmt = {c: f for f, c in K.GEMM_FORMAT_CODES.items() if f != "fp16"}.get(code, "bf16")
        compute = K.GEMM_COMPUTE_DTYPE[fmt]
        one_byte = fmt in ("fp8", "fp8_block", "int8")
        operand_bytes = NVFP4_BYTES_PER_ELEMENT if fmt == NVFP4 else (1.0 if one_byte else 2.0)
        dev.update(
            balance=hw.peak_flops_per_s(compute) / hw.usable_mem_bytes_per_s,
            in_bytes=operand_bytes,
            weight_bytes=operand_bytes,
            out_bytes=2.0,
        )
    elif family == "moe_gemm":
        compute, w, a_in = K.MOE_FORMATS.get(int(float(variant)), K.MOE_FORMATS[0])
        dev.update(balance=hw.peak_flops_per_s(compute) / hw.usable_mem_bytes_per_s, in_bytes=a_in, weight_bytes=w)
    else:
        dev["balance"] = hw.peak_flops_per_s("bf16") / hw.usable_mem_bytes_per_s
    return dev


def basis_name(family: str) -> str:
    # a ViT's attention has the prefill kernel's feature layout (kernel_shapes.attention_encoder_kernel)
    # the MLA op's families take the attention kernels' layouts (simcore.mla: mla_*_attention_kernel)
    return {"gemm": "gemm", "lm_head": "gemm", "moe_gemm": "moe", "attn_encoder": "attn_prefill",
            "mla_prefill": "attn_prefill", "mla_decode": "attn_decode"}.get(family, family)


# ------------------------------------------------------------------------------------------------
# the nonlinear least-squares fit of one sub-model
# ------------------------------------------------------------------------------------------------
def _sigmoid(s: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.clip(s, -40.0, 40.0)))


def fit_logpoly(
    z: np.ndarray,
    roof_s: np.ndarray,
    lat_s: np.ndarray,
    *,
    lo: float = ETA_LO,
    hi: float = ETA_HI,
    ridge: float = RIDGE,
    iters: int = 60,
    overhead_s: float | None = None,
    center: np.ndarray | None = None,
    scale: np.ndarray | None = None,
) -> tuple[np.ndarray, float, np.ndarray, np.ndarray]:
    """Levenberg–Marquardt on Σ (log pred − log meas)², pred = roof/η(z) + overhead.

    Returns (β, overhead_s, center, scale). ``overhead_s`` given → held fixed (not fitted).
    """
    center = z.mean(axis=0) if center is None else center
    scale = np.maximum(z.std(axis=0), 1e-6) if scale is None else scale
    X = quadratic_design((z - center) / scale)
    p = X.shape[1]
    log_lat = np.log(lat_s)
    fit_ovh = overhead_s is None
    ovh0 = float(np.quantile(lat_s, 0.02)) * 0.8 if fit_ovh else float(overhead_s)
    # Initial β: linear LS of the logit of the η implied by subtracting the initial overhead.
    eta_star = roof_s / np.maximum(lat_s - ovh0, 0.05 * lat_s)
    u = np.clip((eta_star - lo) / (hi - lo), 1e-4, 1 - 1e-4)
    reg = ridge * len(z) * np.eye(p)
    reg[0, 0] = 0.0
    beta = np.linalg.solve(X.T @ X + reg + 1e-9 * np.eye(p), X.T @ np.log(u / (1 - u)))
    theta = np.log(max(ovh0, 1e-9))

    def evaluate(b: np.ndarray, th: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
        sig = _sigmoid(X @ b)
        eta = lo + (hi - lo) * sig
        pred = roof_s / eta + np.exp(th)
        r = np.log(pred) - log_lat
        loss = float(r @ r) + ridge * len(z) * float(b[1:] @ b[1:])
        return r, eta, sig, loss

    r, eta, sig, loss = evaluate(beta, theta)
    mu = 1e-3
    for _ in range(iters):
        pred = np.exp(r + log_lat)
        d_eta = (hi - lo) * sig * (1.0 - sig)
        g = -(roof_s / eta**2) * d_eta / pred  # d log pred / d s
        J = X * g[:, None]
        if fit_ovh:
            J = np.column_stack([J, np.exp(theta) / pred])
        q = J.shape[1]
        R = np.zeros((q, q))
        R[1:p, 1:p] = ridge * len(z) * np.eye(p - 1)
        A = J.T @ J + R
        grad = J.T @ r
        grad[:p] += R[:p, :p] @ beta
        improved = False
        for _ in range(8):
            step = np.linalg.solve(A + mu * np.diag(np.diag(A) + 1e-12), -grad)
            nb = beta + step[:p]
            nt = theta + (step[p] if fit_ovh else 0.0)
            nr, neta, nsig, nloss = evaluate(nb, nt)
            if nloss < loss:
                rel = (loss - nloss) / max(loss, 1e-300)
                beta, theta, r, eta, sig, loss = nb, nt, nr, neta, nsig, nloss
                mu = max(mu / 3.0, 1e-9)
                improved = True
                break
            mu *= 4.0
        if not improved or rel < 1e-7:
            break
    return beta, float(np.exp(theta)), center, scale


#: Candidate positions (log KV bytes / L2) of the decode L2 step searched in the target tier.
SPILL_CENTERS = tuple(-0.75 + 0.25 * i for i in range(11))


def fit_spill_center(
    features: np.ndarray, dev: dict[str, float], roof_s: np.ndarray, lat_s: np.ndarray, max_rows: int = 4000
) -> float:
    """Position of the decode L2 step (a GPU property): the candidate whose smooth fit has the least loss.

    Searched on a fixed subsample (≤ ``max_rows`` rows, deterministic) with a short fit, so it costs
    a few seconds at most.
    """
    n = len(roof_s)
    idx = np.arange(n) if n <= max_rows else np.random.default_rng(0).choice(n, max_rows, replace=False)
    best, best_loss = 0.0, np.inf
    for c in SPILL_CENTERS:
        d = dict(dev, l2_spill_center=c)
        z = basis_matrix("attn_decode", features[idx], d)
        beta, ovh, center, scale = fit_logpoly(z, roof_s[idx], lat_s[idx], iters=25)
        m = LogPolyEta("attn_decode", d, tuple(center), tuple(scale), tuple(beta), ETA_LO, ETA_HI, ovh)
        e, o = m.from_basis(z)
        loss = float(np.mean(np.log((roof_s[idx] / e + o) / lat_s[idx]) ** 2))
        if loss < best_loss:
            best, best_loss = c, loss
    return best


__all__ = [
    "ETA_HI",
    "ETA_LO",
    "RIDGE",
    "SPILL_CENTERS",
    "basis_name",
    "device_constants",
    "fit_logpoly",
    "fit_spill_center",
]
