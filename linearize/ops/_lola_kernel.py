"""The Triton kernels behind ``ops.fused_lola`` (imported on first use: this imports Triton)."""

import triton
import triton.language as tl


@triton.jit
def _features(x, w, bias, mf, LOWP: tl.constexpr):
    """Hedgehog features of the rows ``x`` (R, BD): (softmax(p), softmax(-p)) (R, BF) each, float32,
    p = x W + b, the columns past the map's width masked to 0."""
    if LOWP:
        proj = tl.dot(x.to(tl.bfloat16), w.to(tl.bfloat16))
    else:
        proj = tl.dot(x, w, input_precision="ieee")
    proj = proj + bias[None, :]
    if LOWP:  # the torch map's projection is a bfloat16 tensor
        proj = proj.to(tl.bfloat16).to(tl.float32)
    pos = tl.where(mf[None, :], proj, float("-inf"))
    ep = tl.exp(pos - tl.max(pos, axis=1)[:, None])
    pp = ep / tl.sum(ep, axis=1)[:, None]
    neg = tl.where(mf[None, :], -proj, float("-inf"))
    en = tl.exp(neg - tl.max(neg, axis=1)[:, None])
    pn = en / tl.sum(en, axis=1)[:, None]
    if LOWP:  # and so is its softmax
        pp = pp.to(tl.bfloat16).to(tl.float32)
        pn = pn.to(tl.bfloat16).to(tl.float32)
    return pp, pn


@triton.jit
def _product(p, s, LOWP: tl.constexpr):
    """p (R, BF) @ s (BF, BV) in float32: on tensor cores as p x (s's bfloat16 part + the rest)
    where p is exact in bfloat16 (LOWP), else in float32."""
    if LOWP:
        pb = p.to(tl.bfloat16)
        hi = s.to(tl.bfloat16)
        lo = (s - hi.to(tl.float32)).to(tl.bfloat16)
        return tl.dot(pb, hi) + tl.dot(pb, lo)
    else:
        return tl.dot(p, s, input_precision="ieee")


@triton.jit
def _errors(pp, pn, vals, rows, mrows, s_v, base, FH: tl.constexpr, DV: tl.constexpr, R: tl.constexpr,
            BF: tl.constexpr, BV: tl.constexpr, LOWP: tl.constexpr, EPS: tl.constexpr):  # fmt: skip
    """Self-recall error of R candidates (features pp, pn; values at vals + rows * s_v) against
    the state at ``base`` ((2 FH) x (DV + 1) float32, row-major): (R,) float32."""
    W: tl.constexpr = DV + 1
    of = tl.arange(0, BF)
    mf = of < FH
    zp = tl.load(base + of * W + DV, mask=mf, other=0.0)
    zn = tl.load(base + (FH + of) * W + DV, mask=mf, other=0.0)
    den = tl.sum(pp * zp[None, :], axis=1) + tl.sum(pn * zn[None, :], axis=1)
    ok = den > EPS
    den = tl.where(ok, den, 1.0)
    err2 = tl.zeros([R], dtype=tl.float32)
    for v0 in range(0, DV, BV):
        ov = v0 + tl.arange(0, BV)
        mv = ov < DV
        m2 = mf[:, None] & mv[None, :]
        sp = tl.load(base + of[:, None] * W + ov[None, :], mask=m2, other=0.0)
        sn = tl.load(base + (FH + of)[:, None] * W + ov[None, :], mask=m2, other=0.0)
        num = _product(pp, sp, LOWP) + _product(pn, sn, LOWP)
        vv = tl.load(vals + rows[:, None] * s_v + ov[None, :], mask=mrows[:, None] & mv[None, :], other=0.0).to(tl.float32)
        diff = tl.where(ok[:, None], num / den[:, None], 0.0) - vv
        diff = tl.where(mv[None, :], diff, 0.0)
        err2 += tl.sum(diff * diff, axis=1)
    return tl.sqrt(err2)


@triton.jit
def _head(r, linear, wk, bk, n_rep, H: tl.constexpr, D: tl.constexpr, FH: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr,
          BF: tl.constexpr):  # fmt: skip
    """What a program of (batch row, query head) ``r`` starts from: its row b, head h, (batch row, KV
    head) kr (the window is kept per KV head), its [S | z] at ``base``, the key and feature offsets
    and masks, and the head's Hedgehog weight (BD, BF) as stored and bias (BF,) float32."""
    b = r // H
    h = r % H
    kr = b * (H // n_rep) + h // n_rep
    base = linear + r * (2 * FH) * (DV + 1)
    od = tl.arange(0, BD)
    md = od < D
    of = tl.arange(0, BF)
    mf = of < FH
    w = tl.load(wk + h * D * FH + od[:, None] * FH + of[None, :], mask=md[:, None] & mf[None, :], other=0.0)
    bias = tl.load(bk + h * FH + of, mask=mf, other=0.0).to(tl.float32)
    return b, h, kr, base, od, md, of, mf, w, bias


@triton.jit
def lola_errors_kernel(
    linear, errs, cmap, cvals, cvalid, cpos, lmap, lvals, lpos, wk, bk,
    sinks, n_rep,
    H: tl.constexpr, L: tl.constexpr, D: tl.constexpr, FH: tl.constexpr, DV: tl.constexpr,
    BL: tl.constexpr, BD: tl.constexpr, BF: tl.constexpr, BV: tl.constexpr, LOWP: tl.constexpr, EPS: tl.constexpr,
):  # fmt: skip
    """Self-recall errors of one block of candidates of one (row, query head): program (r, c) scores
    cache entries c * BL .. c * BL + BL - 1 into errs[r, :L] (sinks +inf, empty slots -inf); the
    last block index scores the leaving token into errs[r, L] (sinks +inf)."""
    r = tl.program_id(0).to(tl.int64)  # one (batch row, query head)
    c = tl.program_id(1)
    b, h, kr, base, od, md, of, mf, w, bias = _head(r, linear, wk, bk, n_rep, H, D, FH, DV, BD, BF)
    if c * BL >= L:  # the leaving token, as the first of 16 rows (a product's least height)
        o16 = tl.arange(0, 16)
        first = o16 == 0
        x16 = tl.load(lmap + kr * D + o16[:, None] * 0 + od[None, :], mask=first[:, None] & md[None, :], other=0.0)
        pp16, pn16 = _features(x16, w, bias, mf, LOWP)
        e16 = _errors(pp16, pn16, lvals + kr * DV, o16, first, 0, base, FH, DV, 16, BF, BV, LOWP, EPS)
        e16 = tl.where(tl.load(lpos + b) < sinks, float("inf"), e16)
        tl.store(errs + r * (L + 1) + L + o16, e16, mask=first)
    else:
        oc = c * BL + tl.arange(0, BL)
        mc = oc < L
        xb = tl.load(cmap + (r * L + oc)[:, None] * D + od[None, :], mask=mc[:, None] & md[None, :], other=0.0)
        ppb, pnb = _features(xb, w, bias, mf, LOWP)
        e = _errors(ppb, pnb, cvals + r * L * DV, oc, mc, DV, base, FH, DV, BL, BF, BV, LOWP, EPS)
        pos = tl.load(cpos + r * L + oc, mask=mc, other=-3)
        val = tl.load(cvalid + r * L + oc, mask=mc, other=0) != 0
        e = tl.where(pos < sinks, float("inf"), e)
        e = tl.where(val, e, float("-inf"))
        tl.store(errs + r * (L + 1) + oc, e, mask=mc)


@triton.jit
def lola_commit_kernel(
    linear, errs, qphi, q, out, rbuf, held,
    ckeys, cmap, cvals, cvalid, cpos, lkeys, lmap, lvals, lvalid, lpos, wkeys, wvals, wvalid,
    wk, bk, factor,
    sinks, n_rep, scale, weight_tokens,
    H: tl.constexpr, L: tl.constexpr, D: tl.constexpr, FH: tl.constexpr, DV: tl.constexpr, ETA: tl.constexpr,
    BL: tl.constexpr, BS: tl.constexpr, BD: tl.constexpr, BF: tl.constexpr, BV: tl.constexpr, BW: tl.constexpr,
    BDV: tl.constexpr, LOWP: tl.constexpr, EPS: tl.constexpr, SEPARATE: tl.constexpr, READ_STATE: tl.constexpr,
    READ_SPARSE: tl.constexpr,
):  # fmt: skip
    """The rest of the step for one (row, query head), from the candidates' errors: the choice, the
    state's update and read, the cache slot taken, ``held``, and the exact read."""
    r = tl.program_id(0).to(tl.int64)  # one (batch row, query head)
    b, h, kr, base, od, md, of, mf, w, bias = _head(r, linear, wk, bk, n_rep, H, D, FH, DV, BD, BF)
    W: tl.constexpr = DV + 1
    o16 = tl.arange(0, 16)
    first = o16 == 0

    # 1. Select from the errors: the least, the newest position among ties, the lowest slot.
    err_leave = tl.load(errs + r * (L + 1) + L)
    leave_pos = tl.load(lpos + b)
    leave_valid = tl.load(lvalid + b) != 0
    best_e = float("inf")
    best_p = tl.full([], -3, tl.int64)
    best_i = tl.full([], L, tl.int64)
    for c0 in range(0, L, BS):
        oc = c0 + tl.arange(0, BS)
        mc = oc < L
        e = tl.load(errs + r * (L + 1) + oc, mask=mc, other=float("inf"))
        pos = tl.load(cpos + r * L + oc, mask=mc, other=-3)
        bm = tl.min(e, axis=0)
        tie = (e == bm) & mc
        bp = tl.max(tl.where(tie, pos, -3), axis=0)
        bi = tl.min(tl.where(tie & (pos == bp), oc, L + BS), axis=0).to(tl.int64)
        better = (bm < best_e) | ((bm == best_e) & (bp > best_p))
        best_e = tl.where(better, bm, best_e)
        best_p = tl.where(better, bp, best_p)
        best_i = tl.where(better, bi, best_i)

    drop = err_leave <= best_e  # the leaving token is not kept (it loses every tie)
    slot = r * L + best_i
    slot_valid = tl.load(cvalid + slot) != 0
    written = leave_valid & (drop | slot_valid)
    take = leave_valid & (drop == 0)
    xl = tl.load(lmap + kr * D + od, mask=md, other=0.0)
    xc = tl.load(cmap + slot * D + od, mask=md, other=0.0)
    xo = tl.where(first[:, None], tl.where(drop, xl, xc)[None, :], 0.0)
    ppo, pno = _features(xo, w, bias, mf, LOWP)
    fp = tl.sum(tl.where(first[:, None], ppo, 0.0), axis=0)  # (BF,) the features of the token written
    fn = tl.sum(tl.where(first[:, None], pno, 0.0), axis=0)
    scale_w = written.to(tl.float32)
    qp = tl.load(qphi + r * 2 * FH + of, mask=mf, other=0.0)
    qn = tl.load(qphi + r * 2 * FH + FH + of, mask=mf, other=0.0)
    odv = tl.arange(0, BDV)
    mdv = odv < DV
    vl = tl.load(lvals + kr * DV + odv, mask=mdv, other=0.0)

    # 2. The token not kept joins [S | z]; the query reads the updated tiles (into rbuf).
    for v0 in range(0, W, BV):
        ov = v0 + tl.arange(0, BV)
        mv = ov < W
        v_leave = tl.load(lvals + kr * DV + ov, mask=ov < DV, other=0.0).to(tl.float32)
        v_slot = tl.load(cvals + slot * DV + ov, mask=ov < DV, other=0.0).to(tl.float32)
        row = tl.where(ov == DV, 1.0, tl.where(drop, v_leave, v_slot)) * scale_w
        m2 = mf[:, None] & mv[None, :]
        ptr = base + of[:, None] * W + ov[None, :]
        sp = tl.load(ptr, mask=m2, other=0.0) + fp[:, None] * row[None, :]
        tl.store(ptr, sp, mask=m2)
        ptr = base + (FH + of)[:, None] * W + ov[None, :]
        sn = tl.load(ptr, mask=m2, other=0.0) + fn[:, None] * row[None, :]
        tl.store(ptr, sn, mask=m2)
        read = tl.sum(qp[:, None] * sp, axis=0) + tl.sum(qn[:, None] * sn, axis=0)
        tl.store(rbuf + r * W + ov, read, mask=mv)

    # 3. The leaving token takes the slot where it is kept; the tokens held.
    kl = tl.load(lkeys + kr * D + od, mask=md, other=0.0)
    tl.store(ckeys + slot * D + od, kl.to(ckeys.dtype.element_ty), mask=md & take)
    if SEPARATE:
        tl.store(cmap + slot * D + od, xl.to(cmap.dtype.element_ty), mask=md & take)
    tl.store(cvals + slot * DV + odv, vl.to(cvals.dtype.element_ty), mask=mdv & take)
    tl.store(cpos + slot, tl.where(take, leave_pos, best_p))
    tl.store(cvalid + slot, (slot_valid | take).to(cvalid.dtype.element_ty))
    n_held = tl.load(held + r) + written.to(tl.int64)
    tl.store(held + r, n_held)
    tl.debug_barrier()  # the slot and the state's read are stored before the read below loads them

    # 4. The read: the window (with the new token) and the cache exactly, one max, the state linearly.
    qv = tl.load(q + r * D + od, mask=md, other=0.0).to(tl.float32)
    ow = tl.arange(0, BW)
    mw = ow < ETA
    okw = mw & (tl.load(wvalid + b * ETA + ow, mask=mw, other=0) != 0)
    kw = tl.load(wkeys + (kr * ETA + ow)[:, None] * D + od[None, :], mask=mw[:, None] & md[None, :], other=0.0).to(tl.float32)
    s = tl.where(okw, tl.sum(kw * qv[None, :], axis=1) * scale, float("-inf"))
    m = tl.max(s, axis=0)  # the new token is in the window, so m is finite
    p = tl.exp(s - m)
    vw = tl.load(wvals + (kr * ETA + ow)[:, None] * DV + odv[None, :], mask=mw[:, None] & mdv[None, :], other=0.0).to(tl.float32)
    acc = tl.sum(p[:, None] * vw, axis=0)
    den = tl.sum(p, axis=0)
    if READ_SPARSE:
        for c1 in range(0, L, BL):
            orc = c1 + tl.arange(0, BL)
            mrc = orc < L
            ok = mrc & (tl.load(cvalid + r * L + orc, mask=mrc, other=0) != 0)
            kc = tl.load(ckeys + (r * L + orc)[:, None] * D + od[None, :], mask=mrc[:, None] & md[None, :], other=0.0).to(tl.float32)
            sc = tl.where(ok, tl.sum(kc * qv[None, :], axis=1) * scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(sc, axis=0))
            alpha = tl.exp(m - m_new)
            pc = tl.exp(sc - m_new)
            vcb = tl.load(cvals + (r * L + orc)[:, None] * DV + odv[None, :], mask=mrc[:, None] & mdv[None, :], other=0.0).to(tl.float32)
            acc = acc * alpha + tl.sum(pc[:, None] * vcb, axis=0)
            den = den * alpha + tl.sum(pc, axis=0)
            m = m_new
    f = tl.load(factor + h)
    num = f * acc
    den = f * den
    if READ_STATE:  # LoLCATs convention: the linear term is not rescaled by exp(-m)
        lf = tl.where(weight_tokens > 0, tl.minimum(weight_tokens / tl.maximum(n_held, 1).to(tl.float32), 1.0), 1.0)
        num += lf * tl.load(rbuf + r * W + odv, mask=mdv, other=0.0)
        den += lf * tl.load(rbuf + r * W + DV)
    o = tl.where(den > EPS, num / tl.where(den > EPS, den, 1.0), 0.0)
    tl.store(out + r * DV + odv, o.to(out.dtype.element_ty), mask=mdv)
