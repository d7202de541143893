"""The Triton kernels behind ``ops.fused_lola`` (imported on first use: this imports Triton)."""

import triton
import triton.language as tl


@triton.jit
def _features(x, w, bias, mf, LOWP: tl.constexpr):
    """Hedgehog features of the rows ``x`` (R, BD): (softmax(p), softmax(-p)) (R, BF) each, float32,
    p = x W + b, the columns past the map's width masked to 0; each row scaled by the reciprocal of
    its sum (two reciprocals per row instead of 2f divisions)."""
    if LOWP:
        proj = tl.dot(x.to(tl.bfloat16), w.to(tl.bfloat16))
    else:
        proj = tl.dot(x, w, input_precision="ieee")
    proj = proj + bias[None, :]
    if LOWP:  # the torch map's projection is a bfloat16 tensor
        proj = proj.to(tl.bfloat16).to(tl.float32)
    pos = tl.where(mf[None, :], proj, float("-inf"))
    ep = tl.exp(pos - tl.max(pos, axis=1)[:, None])
    pp = ep * (1.0 / tl.sum(ep, axis=1))[:, None]  # one reciprocal per row, not a division per feature
    neg = tl.where(mf[None, :], -proj, float("-inf"))
    en = tl.exp(neg - tl.max(neg, axis=1)[:, None])
    pn = en * (1.0 / tl.sum(en, axis=1))[:, None]
    if LOWP:  # and so is its softmax
        pp = pp.to(tl.bfloat16).to(tl.float32)
        pn = pn.to(tl.bfloat16).to(tl.float32)
    return pp, pn


@triton.jit
def _split(x):
    """float32 x as its bfloat16 part and the rest, in bfloat16: x ~ hi + lo to about 16 bits."""
    hi = x.to(tl.bfloat16)
    return hi, (x - hi.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def _product(p, s, LOWP: tl.constexpr):
    """p (R, BF) @ s (BF, BV) in float32: on tensor cores as p x (s's bfloat16 part + the rest)
    where p is exact in bfloat16 (LOWP 1), as p x s's bfloat16 part alone (LOWP 2: one product, s
    to 8 bits), else in float32."""
    if LOWP == 2:
        return tl.dot(p.to(tl.bfloat16), s.to(tl.bfloat16))
    elif LOWP:
        pb = p.to(tl.bfloat16)
        hi, lo = _split(s)
        return tl.dot(pb, hi) + tl.dot(pb, lo)
    else:
        return tl.dot(p, s, input_precision="ieee")


@triton.jit
def _distance2(num, den, ok, vals, rows, mrows, s_v, ov, mv):
    """Squared distance (R,) of the readouts num / den (where ``ok``, else 0) to the values at
    vals + rows * s_v, over the value columns ``ov`` (``mv``: those below DV)."""
    vv = tl.load(vals + rows[:, None] * s_v + ov[None, :], mask=mrows[:, None] & mv[None, :], other=0.0).to(tl.float32)
    diff = tl.where(ok[:, None], num / den[:, None], 0.0) - vv
    diff = tl.where(mv[None, :], diff, 0.0)
    return tl.sum(diff * diff, axis=1)


@triton.jit
def _state_tile(base, of, ov, m2, FH: tl.constexpr, W: tl.constexpr):
    """The tile (rows ``of``, columns ``ov``, mask ``m2``) of [S | z] at ``base`` ((2 FH) x W float32,
    row-major) for the positive and for the negative features."""
    sp = tl.load(base + of[:, None] * W + ov[None, :], mask=m2, other=0.0)
    sn = tl.load(base + (FH + of)[:, None] * W + ov[None, :], mask=m2, other=0.0)
    return sp, sn


@triton.jit
def _store_state_tile(base, of, ov, m2, sp, sn, FH: tl.constexpr, W: tl.constexpr):
    """``_state_tile``'s inverse: store the two tiles."""
    tl.store(base + of[:, None] * W + ov[None, :], sp, mask=m2)
    tl.store(base + (FH + of)[:, None] * W + ov[None, :], sn, mask=m2)


@triton.jit
def _errors(pp, pn, vals, rows, mrows, s_v, base, rec, FH: tl.constexpr, DV: tl.constexpr, R: tl.constexpr,
            BF: tl.constexpr, BV: tl.constexpr, LOWP: tl.constexpr, EPS: tl.constexpr, STORE: tl.constexpr, RW: tl.constexpr,
            WS: tl.constexpr, SCALAR: tl.constexpr = False):  # fmt: skip
    """Self-recall error of R candidates (features pp, pn; values at vals + rows * s_v) against
    the state at ``base`` ((2 FH) x (DV + 1) float32, row-major, rows WS floats apart): (R,) float32. STORE: each
    candidate's recall [phi S, phi z] also written to its row of ``rec`` (rows of RW >= DV + 1 float32);
    with SCALAR its recall's scalars (v . phi S, |phi S|^2, phi z) instead (rows of RW >= 3)."""
    of = tl.arange(0, BF)
    mf = of < FH
    zp = tl.load(base + of * WS + DV, mask=mf, other=0.0)
    zn = tl.load(base + (FH + of) * WS + DV, mask=mf, other=0.0)
    den = tl.sum(pp * zp[None, :], axis=1) + tl.sum(pn * zn[None, :], axis=1)
    if STORE:
        tl.store(rec + rows * RW + (2 if SCALAR else DV), den, mask=mrows)
    ok = den > EPS
    den = tl.where(ok, den, 1.0)
    err2 = tl.zeros([R], dtype=tl.float32)
    a = tl.zeros([R], dtype=tl.float32)
    b = tl.zeros([R], dtype=tl.float32)
    for v0 in range(0, DV, BV):
        ov = v0 + tl.arange(0, BV)
        mv = ov < DV
        m2 = mf[:, None] & mv[None, :]
        sp, sn = _state_tile(base, of, ov, m2, FH, WS)
        num = _product(pp, sp, LOWP) + _product(pn, sn, LOWP)
        if STORE:
            if SCALAR:
                vv = tl.load(vals + rows[:, None] * s_v + ov[None, :], mask=mrows[:, None] & mv[None, :], other=0.0).to(tl.float32)
                a += tl.sum(tl.where(mv[None, :], num * vv, 0.0), axis=1)
                b += tl.sum(tl.where(mv[None, :], num * num, 0.0), axis=1)
            else:
                tl.store(rec + rows[:, None] * RW + ov[None, :], num, mask=mrows[:, None] & mv[None, :])
        err2 += _distance2(num, den, ok, vals, rows, mrows, s_v, ov, mv)
    if STORE:
        if SCALAR:
            tl.store(rec + rows * RW, a, mask=mrows)
            tl.store(rec + rows * RW + 1, b, mask=mrows)
    return tl.sqrt(err2)


@triton.jit
def _errors_kept(pp, pn, vals, rows, mrows, s_v, rec, pend, FH: tl.constexpr, DV: tl.constexpr, R: tl.constexpr,
                 BF: tl.constexpr, BV: tl.constexpr, EPS: tl.constexpr, RW: tl.constexpr):  # fmt: skip
    """``_errors`` from the candidates' kept recalls instead of the state: each row of ``rec``
    ([phi S, phi z] against the state before the last write) first takes that write, ``pend`` =
    (phi_w (2 FH), [v_w, 1] (DV + 1)) float32, as a = phi . phi_w times [v_w, 1] (the rank-one term
    the write added to the state), and is stored back: (R,) float32, no read of the state."""
    of = tl.arange(0, BF)
    mf = of < FH
    wp = tl.load(pend + of, mask=mf, other=0.0)
    wn = tl.load(pend + FH + of, mask=mf, other=0.0)
    a = tl.sum(pp * wp[None, :], axis=1) + tl.sum(pn * wn[None, :], axis=1)  # (R,)
    den = tl.load(rec + rows * RW + DV, mask=mrows, other=0.0) + a * tl.load(pend + 2 * FH + DV)
    tl.store(rec + rows * RW + DV, den, mask=mrows)
    ok = den > EPS
    den = tl.where(ok, den, 1.0)
    err2 = tl.zeros([R], dtype=tl.float32)
    for v0 in range(0, DV, BV):
        ov = v0 + tl.arange(0, BV)
        mv = ov < DV
        m2 = mrows[:, None] & mv[None, :]
        num = tl.load(rec + rows[:, None] * RW + ov[None, :], mask=m2, other=0.0)
        num += a[:, None] * tl.load(pend + 2 * FH + ov, mask=mv, other=0.0)[None, :]
        tl.store(rec + rows[:, None] * RW + ov[None, :], num, mask=m2)
        err2 += _distance2(num, den, ok, vals, rows, mrows, s_v, ov, mv)
    return tl.sqrt(err2)


@triton.jit
def _scalar_error(a, b, d, vsq, EPS: tl.constexpr):
    """Self-recall error from a recall's scalars: || v - n / d || with a = v . n, b = |n|^2, d the
    denominator and vsq = |v|^2 (|v| where d <= EPS, as the state's read is then taken as 0)."""
    ok = d > EPS
    dd = tl.where(ok, d, 1.0)
    err2 = tl.where(ok, vsq - (2.0 * a - b / dd) / dd, vsq)
    return tl.sqrt(tl.maximum(err2, 0.0))


@triton.jit
def _errors_scalar(pp, pn, vals, rows, mrows, s_v, rec, pend, FH: tl.constexpr, DV: tl.constexpr, R: tl.constexpr,
                   BF: tl.constexpr, BV: tl.constexpr, EPS: tl.constexpr, RW: tl.constexpr, P_U: tl.constexpr,
                   P_VV: tl.constexpr):  # fmt: skip
    """``_errors`` from the candidates' kept recall scalars: each row of ``rec`` (a = v . phi S,
    b = |phi S|^2, d = phi z against the state before the last write) first takes that write,
    ``pend`` = (phi_w (2 FH), [v_w, 1] (DV + 1), u = S v_w (2 FH) against that state, |v_w|^2): with
    c = phi . phi_w, a += c (v . v_w), b += 2 c (phi . u) + c^2 |v_w|^2, d += c; and is stored
    back: (R,) float32, O(f + Dv) per candidate and no read of the state."""
    of = tl.arange(0, BF)
    mf = of < FH
    wp = tl.load(pend + of, mask=mf, other=0.0)
    wn = tl.load(pend + FH + of, mask=mf, other=0.0)
    up = tl.load(pend + P_U + of, mask=mf, other=0.0)
    un = tl.load(pend + P_U + FH + of, mask=mf, other=0.0)
    c = tl.sum(pp * wp[None, :], axis=1) + tl.sum(pn * wn[None, :], axis=1)  # (R,)
    cu = tl.sum(pp * up[None, :], axis=1) + tl.sum(pn * un[None, :], axis=1)
    vd = tl.zeros([R], dtype=tl.float32)
    vsq = tl.zeros([R], dtype=tl.float32)
    for v0 in range(0, DV, BV):
        ov = v0 + tl.arange(0, BV)
        mv = ov < DV
        vv = tl.load(vals + rows[:, None] * s_v + ov[None, :], mask=mrows[:, None] & mv[None, :], other=0.0).to(tl.float32)
        vw = tl.load(pend + 2 * FH + ov, mask=mv, other=0.0)
        vd += tl.sum(vv * vw[None, :], axis=1)
        vsq += tl.sum(vv * vv, axis=1)
    a = tl.load(rec + rows * RW, mask=mrows, other=0.0) + c * vd
    b = tl.load(rec + rows * RW + 1, mask=mrows, other=0.0) + c * (2.0 * cu + c * tl.load(pend + P_VV))
    d = tl.load(rec + rows * RW + 2, mask=mrows, other=0.0) + c * tl.load(pend + 2 * FH + DV)
    tl.store(rec + rows * RW, a, mask=mrows)
    tl.store(rec + rows * RW + 1, b, mask=mrows)
    tl.store(rec + rows * RW + 2, d, mask=mrows)
    return _scalar_error(a, b, d, vsq, EPS)


@triton.jit
def _leaving_kept(pp16, pn16, first, qp, qn, vals, base, lrec, qrec, ring, n_ring, FH: tl.constexpr, DV: tl.constexpr,
                  BF: tl.constexpr, BV: tl.constexpr, K: tl.constexpr, LOWP: tl.constexpr, EPS: tl.constexpr, WS: tl.constexpr):  # fmt: skip
    """The leaving token's recall and the query's read against the true [S | z]: the state at
    ``base`` as stored plus the ``n_ring`` writes deferred in ``ring`` (K rows of (phi (2 FH),
    [v, 1] (DV + 1))), in one pass over the state. The token's features are row 0 of (pp16, pn16),
    the query's (qp, qn) (BF,) float32. Stores the recall in ``lrec`` and the read in ``qrec`` (DV + 1
    each); returns the token's self-recall error."""
    W: tl.constexpr = DV + 1
    RING: tl.constexpr = 2 * FH + W
    of = tl.arange(0, BF)
    mf = of < FH
    ok_ = tl.arange(0, K)
    mk = ok_ < n_ring
    lp = tl.sum(tl.where(first[:, None], pp16, 0.0), axis=0)  # (BF,)
    ln = tl.sum(tl.where(first[:, None], pn16, 0.0), axis=0)
    rp = tl.load(ring + ok_[:, None] * RING + of[None, :], mask=mk[:, None] & mf[None, :], other=0.0)  # (K, BF)
    rn = tl.load(ring + ok_[:, None] * RING + FH + of[None, :], mask=mk[:, None] & mf[None, :], other=0.0)
    a_l = tl.sum(rp * lp[None, :], axis=1) + tl.sum(rn * ln[None, :], axis=1)  # (K,) phi_l . phi_j
    a_q = tl.sum(rp * qp[None, :], axis=1) + tl.sum(rn * qn[None, :], axis=1)
    zp = tl.load(base + of * WS + DV, mask=mf, other=0.0)
    zn = tl.load(base + (FH + of) * WS + DV, mask=mf, other=0.0)
    den = tl.sum(lp * zp, axis=0) + tl.sum(ln * zn, axis=0)
    den += tl.sum(a_l * tl.load(ring + ok_ * RING + 2 * FH + DV, mask=mk, other=0.0), axis=0)
    ok = den > EPS
    den = tl.where(ok, den, 1.0)
    err2 = 0.0
    for v0 in range(0, W, BV):
        ov = v0 + tl.arange(0, BV)
        mv = ov < W
        m2 = mf[:, None] & (ov < WS)[None, :]  # the state's padding too (zero): whole 16-byte groups
        sp, sn = _state_tile(base, of, ov, m2, FH, WS)
        rows = tl.load(ring + ok_[:, None] * RING + 2 * FH + ov[None, :], mask=mk[:, None] & mv[None, :], other=0.0)  # (K, BV)
        num16 = _product(pp16, sp, LOWP) + _product(pn16, sn, LOWP)
        num = tl.sum(tl.where(first[:, None], num16, 0.0), axis=0) + tl.sum(a_l[:, None] * rows, axis=0)  # (BV,)
        tl.store(lrec + ov, num, mask=mv)
        read = tl.sum(qp[:, None] * sp, axis=0) + tl.sum(qn[:, None] * sn, axis=0) + tl.sum(a_q[:, None] * rows, axis=0)
        tl.store(qrec + ov, read, mask=mv)
        vv = tl.load(vals + ov, mask=ov < DV, other=0.0).to(tl.float32)
        diff = tl.where(ov < DV, tl.where(ok, num / den, 0.0) - vv, 0.0)
        err2 += tl.sum(diff * diff, axis=0)
    return tl.sqrt(err2)


@triton.jit
def _store_errors(e, errs, cpos, cvalid, r, oc, mc, sinks, L: tl.constexpr):
    """Store the errors ``e`` of cache slots ``oc`` (mask ``mc``) of (row, query head) ``r`` into
    errs[r, :L]: sinks +inf (never written into the state), empty slots -inf (taken first)."""
    pos = tl.load(cpos + r * L + oc, mask=mc, other=-3)
    val = tl.load(cvalid + r * L + oc, mask=mc, other=0) != 0
    e = tl.where(pos < sinks, float("inf"), e)
    e = tl.where(val, e, float("-inf"))
    tl.store(errs + r * (L + 1) + oc, e, mask=mc)


@triton.jit
def _head(r, linear, wk, bk, n_rep, H: tl.constexpr, D: tl.constexpr, FH: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr,
          BF: tl.constexpr, WS: tl.constexpr):  # fmt: skip
    """What a program of (batch row, query head) ``r`` starts from: its row b, head h, (batch row, KV
    head) kr (the window is kept per KV head), its [S | z] at ``base``, the key and feature offsets
    and masks, and the head's Hedgehog weight (BD, BF) as stored and bias (BF,) float32."""
    b = r // H
    h = r % H
    kr = b * (H // n_rep) + h // n_rep
    base = linear + r * (2 * FH) * WS
    od = tl.arange(0, BD)
    md = od < D
    of = tl.arange(0, BF)
    mf = of < FH
    w = tl.load(wk + h * D * FH + od[:, None] * FH + of[None, :], mask=md[:, None] & mf[None, :], other=0.0)
    bias = tl.load(bk + h * FH + of, mask=mf, other=0.0).to(tl.float32)
    return b, h, kr, base, od, md, of, mf, w, bias


@triton.jit
def _errors_program(
    r, c, linear, errs, cmap, cvals, cvalid, cpos, lmap, lvals, lpos, wk, bk, recall, pending, rok, lrec, ring, ring_n, qphi, rbuf,
    sinks, n_rep,
    H: tl.constexpr, L: tl.constexpr, D: tl.constexpr, FH: tl.constexpr, DV: tl.constexpr,
    BL: tl.constexpr, BD: tl.constexpr, BF: tl.constexpr, BV: tl.constexpr, LOWP: tl.constexpr, EPS: tl.constexpr,
    KEEP: tl.constexpr, RW: tl.constexpr, K: tl.constexpr, WS: tl.constexpr,
):  # fmt: skip
    """Self-recall errors of one block of candidates of one (row, query head) ``r`` (int64): block ``c`` scores
    cache entries c * BL .. c * BL + BL - 1 into errs[r, :L] (sinks +inf, empty slots -inf); the
    last block index scores the leaving token into errs[r, L] (sinks +inf). KEEP: the cache
    entries' recalls are kept in ``recall`` (B Hq, L, RW), [phi S, phi z] in the first DV + 1
    columns: where the row's are current (``rok[b]``) they take the last write (``pending``) and
    give the errors without the state, else they are computed from it and stored. With them the
    state's writes are deferred (``ring``, ``ring_n`` of them per (row, query head), K at most): the
    leaving token's program reads the state once for the token's recall (to ``lrec`` (B Hq, RW)) and
    for the query's read (to ``rbuf`` (B Hq, DV + 1), features ``qphi``), each with the deferred
    writes added."""
    b, h, kr, base, od, md, of, mf, w, bias = _head(r, linear, wk, bk, n_rep, H, D, FH, DV, BD, BF, WS)
    PW: tl.constexpr = 2 * FH + DV + 1  # the pending write's floats (fused_lola.pending_width)
    if c * BL >= L:  # the leaving token, as the first of 16 rows (a product's least height)
        o16 = tl.arange(0, 16)
        first = o16 == 0
        x16 = tl.load(lmap + kr * D + o16[:, None] * 0 + od[None, :], mask=first[:, None] & md[None, :], other=0.0)
        pp16, pn16 = _features(x16, w, bias, mf, LOWP)
        if KEEP:
            qp = tl.load(qphi + r * 2 * FH + of, mask=mf, other=0.0)
            qn = tl.load(qphi + r * 2 * FH + FH + of, mask=mf, other=0.0)
            e16 = _leaving_kept(pp16, pn16, first, qp, qn, lvals + kr * DV, base, lrec + r * RW, rbuf + r * (DV + 1),
                                ring + r * K * (2 * FH + DV + 1), tl.load(ring_n + r), FH, DV, BF, BV, K, LOWP, EPS, WS)  # fmt: skip
        else:
            e16 = _errors(pp16, pn16, lvals + kr * DV, o16, first, 0, base, lrec + r * RW, FH, DV, 16, BF, BV, LOWP, EPS, False, RW, WS)
        e16 = tl.where(tl.load(lpos + b) < sinks, float("inf"), e16)
        tl.store(errs + r * (L + 1) + L + o16, e16, mask=first)
    else:
        oc = c * BL + tl.arange(0, BL)
        mc = oc < L
        xb = tl.load(cmap + (r * L + oc)[:, None] * D + od[None, :], mask=mc[:, None] & md[None, :], other=0.0)
        ppb, pnb = _features(xb, w, bias, mf, LOWP)
        rec = recall + r * L * RW
        if KEEP:
            if tl.load(rok + b) != 0:
                e = _errors_kept(ppb, pnb, cvals + r * L * DV, oc, mc, DV, rec, pending + r * PW, FH, DV, BL, BF, BV, EPS, RW)
            else:
                e = _errors(ppb, pnb, cvals + r * L * DV, oc, mc, DV, base, rec, FH, DV, BL, BF, BV, LOWP, EPS, True, RW, WS)
        else:
            e = _errors(ppb, pnb, cvals + r * L * DV, oc, mc, DV, base, rec, FH, DV, BL, BF, BV, LOWP, EPS, False, RW, WS)
        _store_errors(e, errs, cpos, cvalid, r, oc, mc, sinks, L)


@triton.jit
def _scalar_errors_program(
    r, c, linear, errs, cmap, cvals, cvalid, cpos, lmap, lvals, lpos, wk, bk, recall, pending, rok, cfeat, sinks, n_rep,
    H: tl.constexpr, L: tl.constexpr, D: tl.constexpr, FH: tl.constexpr, DV: tl.constexpr,
    BL: tl.constexpr, BD: tl.constexpr, BF: tl.constexpr, BV: tl.constexpr, LOWP: tl.constexpr, EPS: tl.constexpr,
    RW: tl.constexpr, WS: tl.constexpr, FROM_STATE: tl.constexpr, KF: tl.constexpr,
):  # fmt: skip
    """``_errors_program`` with the recalls kept as scalars (``recall`` (B Hq, L, RW): v . phi S, |phi S|^2,
    phi z), for the rows whose recalls are current (FROM_STATE False: the slots' from their scalars and the
    pending write, the leaving token's from the scalars the last commit left in ``pending``; no read of
    the state) or for the others (FROM_STATE True: both from the state, their scalars stored). A row is
    one or the other, so the two passes are two launches (or two calls in one program), each compiled
    without the other's registers and shared memory. KF: the slots' features are kept too (``cfeat``
    (B Hq, L, 2 FH) in the map's dtype): the pass from the state stores them, the other reads them
    instead of making them from the keys."""
    b = r // H
    if (tl.load(rok + b) != 0) != FROM_STATE:
        b, h, kr, base, od, md, of, mf, w, bias = _head(r, linear, wk, bk, n_rep, H, D, FH, DV, BD, BF, WS)
        PW: tl.constexpr = 4 * FH + DV + 5  # the pending write's floats (fused_lola.pending_width)
        P_U: tl.constexpr = 2 * FH + DV + 1
        P_VV: tl.constexpr = 4 * FH + DV + 1
        P_LEAVE: tl.constexpr = 4 * FH + DV + 2
        lr = pending + r * PW + P_LEAVE
        if c * BL >= L:  # the leaving token
            o16 = tl.arange(0, 16)
            first = o16 == 0
            if FROM_STATE:  # as the first of 16 rows (a product's least height)
                x16 = tl.load(lmap + kr * D + o16[:, None] * 0 + od[None, :], mask=first[:, None] & md[None, :], other=0.0)
                pp16, pn16 = _features(x16, w, bias, mf, LOWP)
                e16 = _errors(pp16, pn16, lvals + kr * DV, o16, first, 0, base, lr, FH, DV, 16, BF, BV, LOWP, EPS, True, RW, WS, True)
            else:
                odv = tl.arange(0, BV)
                vsq = 0.0
                for v0 in range(0, DV, BV):
                    vl = tl.load(lvals + kr * DV + v0 + odv, mask=v0 + odv < DV, other=0.0).to(tl.float32)
                    vsq += tl.sum(vl * vl, axis=0)
                e16 = tl.where(first, _scalar_error(tl.load(lr), tl.load(lr + 1), tl.load(lr + 2), vsq, EPS), 0.0)
            e16 = tl.where(tl.load(lpos + b) < sinks, float("inf"), e16)
            tl.store(errs + r * (L + 1) + L + o16, e16, mask=first)
        else:
            oc = c * BL + tl.arange(0, BL)
            mc = oc < L
            fb = cfeat + (r * L + oc)[:, None] * (2 * FH) + of[None, :]
            mfb = mc[:, None] & mf[None, :]
            if KF and not FROM_STATE:
                ppb = tl.load(fb, mask=mfb, other=0.0).to(tl.float32)
                pnb = tl.load(fb + FH, mask=mfb, other=0.0).to(tl.float32)
            else:
                xb = tl.load(cmap + (r * L + oc)[:, None] * D + od[None, :], mask=mc[:, None] & md[None, :], other=0.0)
                ppb, pnb = _features(xb, w, bias, mf, LOWP)
                if KF:
                    tl.store(fb, ppb.to(cfeat.dtype.element_ty), mask=mfb)
                    tl.store(fb + FH, pnb.to(cfeat.dtype.element_ty), mask=mfb)
            rec = recall + r * L * RW
            if FROM_STATE:
                e = _errors(ppb, pnb, cvals + r * L * DV, oc, mc, DV, base, rec, FH, DV, BL, BF, BV, LOWP, EPS, True, RW, WS, True)
            else:
                e = _errors_scalar(ppb, pnb, cvals + r * L * DV, oc, mc, DV, rec, pending + r * PW, FH, DV, BL, BF, BV, EPS, RW, P_U, P_VV)
            _store_errors(e, errs, cpos, cvalid, r, oc, mc, sinks, L)


@triton.jit
def lola_errors_kernel(
    linear, errs, cmap, cvals, cvalid, cpos, lmap, lvals, lpos, wk, bk, recall, pending, rok, lrec, ring, ring_n, qphi, rbuf, cfeat,
    sinks, n_rep, rows,
    H: tl.constexpr, L: tl.constexpr, D: tl.constexpr, FH: tl.constexpr, DV: tl.constexpr,
    BL: tl.constexpr, BD: tl.constexpr, BF: tl.constexpr, BV: tl.constexpr, LOWP: tl.constexpr, EPS: tl.constexpr,
    KEEP: tl.constexpr, RW: tl.constexpr, K: tl.constexpr, WS: tl.constexpr,
    NB: tl.constexpr, FROM_STATE: tl.constexpr, KF: tl.constexpr, RG: tl.constexpr,
):  # fmt: skip
    """``_errors_program`` for block pid % (NB + 1) of (row, query head) pid // (NB + 1): the NB cache
    blocks and the leaving token of one (row, head) are neighbours in the launch order, so the state
    they all read comes from memory about once and from L2 after (in a grid with the blocks as its
    slower axis each block read every row's state from memory again). Scalar recalls (KEEP 2):
    ``_scalar_errors_program``'s pass FROM_STATE; the pass from the state (FROM_STATE) instead takes
    RG of the ``rows`` (row, query head) pairs per program, pid * RG on, and each stale one's blocks in
    turn: it is compiled for the state's products (one or two programs an SM), and where every row is
    current (every step but the first) each program only reads its rows' flags and returns."""
    pid = tl.program_id(0)
    if KEEP == 2 and FROM_STATE:
        og = pid * RG + tl.arange(0, RG)
        stale = (og < rows) & (tl.load(rok + og // H, mask=og < rows, other=1) == 0)
        if tl.max(stale.to(tl.int32), axis=0) != 0:
            for i in range(RG):
                r = pid.to(tl.int64) * RG + i
                if r < rows:
                    for c in range(NB + 1):
                        _scalar_errors_program(r, c, linear, errs, cmap, cvals, cvalid, cpos, lmap, lvals, lpos, wk, bk, recall, pending,
                                               rok, cfeat, sinks, n_rep, H, L, D, FH, DV, BL, BD, BF, BV, LOWP, EPS, RW, WS, True, KF)  # fmt: skip
        return
    r = (pid // (NB + 1)).to(tl.int64)
    if KEEP == 2:
        _scalar_errors_program(r, pid % (NB + 1), linear, errs, cmap, cvals, cvalid, cpos, lmap, lvals, lpos, wk, bk, recall, pending,
                               rok, cfeat, sinks, n_rep, H, L, D, FH, DV, BL, BD, BF, BV, LOWP, EPS, RW, WS, FROM_STATE, KF)  # fmt: skip
    else:
        _errors_program(r, pid % (NB + 1), linear, errs, cmap, cvals, cvalid, cpos, lmap, lvals, lpos, wk, bk, recall, pending, rok, lrec,
                        ring, ring_n, qphi, rbuf, sinks, n_rep, H, L, D, FH, DV, BL, BD, BF, BV, LOWP, EPS, KEEP, RW, K, WS)  # fmt: skip


@triton.jit
def _commit_program(
    r, linear, errs, qphi, q, out, rbuf, held,
    ckeys, cmap, cvals, cvalid, cpos, lkeys, lmap, lvals, lvalid, lpos, wkeys, wvals, wvalid, wmap, windex,
    wk, bk, factor, recall, pending, rok, lrec, ring, ring_n, cfeat,
    sinks, n_rep, scale, weight_tokens,
    H: tl.constexpr, L: tl.constexpr, D: tl.constexpr, FH: tl.constexpr, DV: tl.constexpr, ETA: tl.constexpr,
    BL: tl.constexpr, BS: tl.constexpr, BD: tl.constexpr, BF: tl.constexpr, BV: tl.constexpr, BW: tl.constexpr,
    BDV: tl.constexpr, LOWP: tl.constexpr, EPS: tl.constexpr, SEPARATE: tl.constexpr, READ_STATE: tl.constexpr,
    READ_SPARSE: tl.constexpr, KEEP: tl.constexpr, RW: tl.constexpr, K: tl.constexpr, WS: tl.constexpr, KF: tl.constexpr,
    MARK: tl.constexpr,
):  # fmt: skip
    """The rest of the step for one (row, query head) ``r`` (int64), from the candidates' errors: the choice, the
    state's update and read, the cache slot taken, ``held``, and the exact read. KEEP: the write is
    left in ``pending`` for the next step's errors kernel to add to the kept recalls, the slot taken
    gets the leaving token's recall (``lrec``), and the row's recalls are current (``rok``); the
    write joins the deferred ones (``ring``) instead of [S | z], which takes them all once K are
    waiting, and the query's read (``rbuf``, from the errors kernel) gets its term. MARK: the row's
    recalls are marked current here (else by the caller, once every program is done: a program of
    another head of the row may not have scored its cache yet)."""
    b, h, kr, base, od, md, of, mf, w, bias = _head(r, linear, wk, bk, n_rep, H, D, FH, DV, BD, BF, WS)
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
    if KEEP == 2:  # and, as row 1, the next leaving token (the window ring's oldest, ``windex``)
        ni = tl.load(windex)
        xn = tl.load(wmap + (kr * ETA + ni) * D + od, mask=md, other=0.0)
        xo = tl.where((o16 == 1)[:, None], xn[None, :], xo)
        if KF:  # and, as row 2, the leaving token (the slot it takes keeps its features)
            xo = tl.where((o16 == 2)[:, None], xl[None, :], xo)
    ppo, pno = _features(xo, w, bias, mf, LOWP)
    fp = tl.sum(tl.where(first[:, None], ppo, 0.0), axis=0)  # (BF,) the features of the token written
    fn = tl.sum(tl.where(first[:, None], pno, 0.0), axis=0)
    if KEEP == 2:
        np_ = tl.sum(tl.where((o16 == 1)[:, None], ppo, 0.0), axis=0)  # (BF,) the next leaving token's
        nn_ = tl.sum(tl.where((o16 == 1)[:, None], pno, 0.0), axis=0)
        if KF:  # the slot the leaving token takes keeps its features
            lfp = tl.sum(tl.where((o16 == 2)[:, None], ppo, 0.0), axis=0)  # (BF,)
            lfn = tl.sum(tl.where((o16 == 2)[:, None], pno, 0.0), axis=0)
            tl.store(cfeat + slot * (2 * FH) + of, lfp.to(cfeat.dtype.element_ty), mask=mf & take)
            tl.store(cfeat + slot * (2 * FH) + FH + of, lfn.to(cfeat.dtype.element_ty), mask=mf & take)
    scale_w = written.to(tl.float32)
    PW: tl.constexpr = 2 * FH + W + (2 * FH + 4) * (KEEP // 2)  # the pending write's floats (fused_lola.pending_width)
    P_U: tl.constexpr = 2 * FH + W
    P_VV: tl.constexpr = 4 * FH + W
    P_LEAVE: tl.constexpr = 4 * FH + W + 1
    pend = pending + r * PW  # (phi_w, [v_w, 1] or 0): the write, for the kept recalls
    if KEEP:
        tl.store(pend + of, fp, mask=mf)
        tl.store(pend + FH + of, fn, mask=mf)
    qp = tl.load(qphi + r * 2 * FH + of, mask=mf, other=0.0)
    qn = tl.load(qphi + r * 2 * FH + FH + of, mask=mf, other=0.0)
    odv = tl.arange(0, BDV)
    mdv = odv < DV
    vl = tl.load(lvals + kr * DV + odv, mask=mdv, other=0.0)

    # 2. The token not kept joins [S | z]; the query reads the updated tiles (into rbuf). With kept
    # recalls it joins the deferred writes, and [S | z] takes them all once K are waiting.
    if KEEP == 1:
        RING: tl.constexpr = 2 * FH + W
        n_ring = tl.load(ring_n + r)
        own = ring + r * K * RING
        fold = n_ring + 1 >= K
        a_q = tl.sum(qp * fp, axis=0) + tl.sum(qn * fn, axis=0)  # phi_q . phi_w
        tl.store(own + n_ring * RING + of, fp, mask=mf & (fold == 0))
        tl.store(own + n_ring * RING + FH + of, fn, mask=mf & (fold == 0))
    if KEEP != 1:  # z += phi_w (the written row's 1) and the query's read of it; with KEEP 2 the next leaving token's phi z
        zp = tl.load(base + of * WS + DV, mask=mf, other=0.0) + fp * scale_w
        zn = tl.load(base + (FH + of) * WS + DV, mask=mf, other=0.0) + fn * scale_w
        tl.store(base + of * WS + DV, zp, mask=mf)
        tl.store(base + (FH + of) * WS + DV, zn, mask=mf)
        tl.store(rbuf + r * W + DV, tl.sum(qp * zp, axis=0) + tl.sum(qn * zn, axis=0))
        if KEEP == 2:
            tl.store(pend + 2 * FH + DV, scale_w)
            d_n = tl.sum(np_ * zp, axis=0) + tl.sum(nn_ * zn, axis=0)  # the next leaving token's phi z, against the z updated
    # Without deferred writes the tiles cover the values only, the z column a vector above (a tile of
    # BV columns for it would be all but empty: DV is a multiple of BV in the shapes served). With them
    # the tiles cover z and the state's padding too (its rows stay zero): whole 16-byte groups.
    NV: tl.constexpr = W if KEEP == 1 else DV
    NS: tl.constexpr = WS if KEEP == 1 else DV
    for v0 in range(0, NV, BV):
        ov = v0 + tl.arange(0, BV)
        mv = ov < NV
        m2 = mf[:, None] & (ov < NS)[None, :]
        v_leave = tl.load(lvals + kr * DV + ov, mask=ov < DV, other=0.0).to(tl.float32)
        v_slot = tl.load(cvals + slot * DV + ov, mask=ov < DV, other=0.0).to(tl.float32)
        row = tl.where(ov == DV, 1.0, tl.where(drop, v_leave, v_slot)) * scale_w
        if KEEP == 1:
            tl.store(pend + 2 * FH + ov, row, mask=mv)
            tl.store(rbuf + r * W + ov, tl.load(rbuf + r * W + ov, mask=mv, other=0.0) + a_q * row, mask=mv)
            tl.store(own + n_ring * RING + 2 * FH + ov, row, mask=mv & (fold == 0))
            if fold:  # [S | z] += the deferred writes and this one
                addp = fp[:, None] * row[None, :]
                addn = fn[:, None] * row[None, :]
                for j in tl.static_range(K - 1):
                    rj = tl.load(own + j * RING + 2 * FH + ov, mask=mv, other=0.0)
                    addp += tl.load(own + j * RING + of, mask=mf, other=0.0)[:, None] * rj[None, :]
                    addn += tl.load(own + j * RING + FH + of, mask=mf, other=0.0)[:, None] * rj[None, :]
                sp, sn = _state_tile(base, of, ov, m2, FH, WS)
                _store_state_tile(base, of, ov, m2, sp + addp, sn + addn, FH, WS)
        else:
            sp, sn = _state_tile(base, of, ov, m2, FH, WS)
            if KEEP == 2:
                tl.store(pend + 2 * FH + ov, row, mask=mv)
            sp += fp[:, None] * row[None, :]
            sn += fn[:, None] * row[None, :]
            _store_state_tile(base, of, ov, m2, sp, sn, FH, WS)
            read = tl.sum(qp[:, None] * sp, axis=0) + tl.sum(qn[:, None] * sn, axis=0)
            tl.store(rbuf + r * W + ov, read, mask=mv)
    if KEEP == 1:
        tl.store(ring_n + r, tl.where(fold, 0, n_ring + 1))
    if KEEP == 2:
        # A second pass over the updated tiles (from L2; apart from the first, whose registers it would
        # add to): u = S v_w against the state before the write, as S' v_w - phi_w |v_w|^2, and the next
        # leaving token's scalars against the state after it (its window slot is the ring's oldest, ``windex``).
        tl.debug_barrier()  # the updated tiles and the pending row are stored before this pass loads them
        la = tl.load(pend + P_LEAVE)  # the leaving token's scalars (the slot it takes gets them), before the next one's replace them
        lb = tl.load(pend + P_LEAVE + 1)
        ld = tl.load(pend + P_LEAVE + 2)
        up = tl.zeros([BF], dtype=tl.float32)
        un = tl.zeros([BF], dtype=tl.float32)
        vsq_w = 0.0
        a_n = 0.0
        b_n = 0.0
        for v0 in range(0, DV, BV):
            ov = v0 + tl.arange(0, BV)
            mv = ov < DV
            m2 = mf[:, None] & mv[None, :]
            sp, sn = _state_tile(base, of, ov, m2, FH, WS)
            rv = tl.load(pend + 2 * FH + ov, mask=mv, other=0.0)
            up += tl.sum(sp * rv[None, :], axis=1)
            un += tl.sum(sn * rv[None, :], axis=1)
            vsq_w += tl.sum(rv * rv, axis=0)
            nr = tl.sum(np_[:, None] * sp, axis=0) + tl.sum(nn_[:, None] * sn, axis=0)  # (BV,) phi S
            vn = tl.load(wvals + (kr * ETA + ni) * DV + ov, mask=mv, other=0.0).to(tl.float32)
            a_n += tl.sum(vn * nr, axis=0)
            b_n += tl.sum(nr * nr, axis=0)
        up -= fp * vsq_w
        un -= fn * vsq_w
        tl.store(pend + P_U + of, up, mask=mf)
        tl.store(pend + P_U + FH + of, un, mask=mf)
        tl.store(pend + P_VV, vsq_w)
        tl.store(pend + P_LEAVE, a_n)
        tl.store(pend + P_LEAVE + 1, b_n)
        tl.store(pend + P_LEAVE + 2, d_n)

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
    if KEEP == 2:  # the slot's recall scalars: the leaving token's, against the state before the write (pending)
        tl.store(recall + slot * RW, la, mask=take)
        tl.store(recall + slot * RW + 1, lb, mask=take)
        tl.store(recall + slot * RW + 2, ld, mask=take)
    if KEEP == 1:
        for v0 in range(0, W, BV):
            ov = v0 + tl.arange(0, BV)
            mv = ov < W
            tl.store(recall + slot * RW + ov, tl.load(lrec + r * RW + ov, mask=mv, other=0.0), mask=mv & take)
    if KEEP:
        if MARK:
            tl.store(rok + b, 1)
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


@triton.jit
def lola_commit_kernel(
    linear, errs, qphi, q, out, rbuf, held,
    ckeys, cmap, cvals, cvalid, cpos, lkeys, lmap, lvals, lvalid, lpos, wkeys, wvals, wvalid, wmap, windex,
    wk, bk, factor, recall, pending, rok, lrec, ring, ring_n, cfeat,
    sinks, n_rep, scale, weight_tokens,
    H: tl.constexpr, L: tl.constexpr, D: tl.constexpr, FH: tl.constexpr, DV: tl.constexpr, ETA: tl.constexpr,
    BL: tl.constexpr, BS: tl.constexpr, BD: tl.constexpr, BF: tl.constexpr, BV: tl.constexpr, BW: tl.constexpr,
    BDV: tl.constexpr, LOWP: tl.constexpr, EPS: tl.constexpr, SEPARATE: tl.constexpr, READ_STATE: tl.constexpr,
    READ_SPARSE: tl.constexpr, KEEP: tl.constexpr, RW: tl.constexpr, K: tl.constexpr, WS: tl.constexpr, KF: tl.constexpr,
):  # fmt: skip
    """``_commit_program`` for (row, query head) pid, after ``lola_errors_kernel``."""
    _commit_program(tl.program_id(0).to(tl.int64), linear, errs, qphi, q, out, rbuf, held, ckeys, cmap, cvals, cvalid, cpos, lkeys, lmap, lvals, lvalid,
                    lpos, wkeys, wvals, wvalid, wmap, windex, wk, bk, factor, recall, pending, rok, lrec, ring, ring_n, cfeat, sinks, n_rep, scale,
                    weight_tokens, H, L, D, FH, DV, ETA, BL, BS, BD, BF, BV, BW, BDV, LOWP, EPS, SEPARATE, READ_STATE, READ_SPARSE,
                    KEEP, RW, K, WS, KF, True)  # fmt: skip


@triton.jit
def lola_step_kernel(
    linear, errs, qphi, q, out, rbuf, held,
    ckeys, cmap, cvals, cvalid, cpos, lkeys, lmap, lvals, lvalid, lpos, wkeys, wvals, wvalid, wmap, windex,
    wk, bk, factor, recall, pending, rok, lrec, ring, ring_n, cfeat,
    sinks, n_rep, scale, weight_tokens,
    H: tl.constexpr, L: tl.constexpr, D: tl.constexpr, FH: tl.constexpr, DV: tl.constexpr, ETA: tl.constexpr,
    BL: tl.constexpr, BS: tl.constexpr, BD: tl.constexpr, BF: tl.constexpr, BV: tl.constexpr, BW: tl.constexpr,
    BDV: tl.constexpr, LOWP: tl.constexpr, EPS: tl.constexpr, SEPARATE: tl.constexpr, READ_STATE: tl.constexpr,
    READ_SPARSE: tl.constexpr, KEEP: tl.constexpr, RW: tl.constexpr, K: tl.constexpr, WS: tl.constexpr, KF: tl.constexpr,
    NB: tl.constexpr,
):  # fmt: skip
    """The whole step of one (row, query head) pid in one program: its NB cache blocks' and the
    leaving token's errors (``_errors_program``, one after another), then ``_commit_program``. The
    state is read from memory once (the later passes find it in cache) and written once, and the
    slots' keys and values are read once for the errors and the read; but a row's blocks no
    longer run in parallel. The caller marks the rows' recalls current (``rok``) after the launch."""
    r = tl.program_id(0).to(tl.int64)
    for c in range(NB + 1):
        if KEEP == 2:  # a row's recalls are either current or not: one of the two passes runs
            _scalar_errors_program(r, c, linear, errs, cmap, cvals, cvalid, cpos, lmap, lvals, lpos, wk, bk, recall, pending, rok, cfeat,
                                   sinks, n_rep, H, L, D, FH, DV, BL, BD, BF, BV, LOWP, EPS, RW, WS, True, KF)  # fmt: skip
            _scalar_errors_program(r, c, linear, errs, cmap, cvals, cvalid, cpos, lmap, lvals, lpos, wk, bk, recall, pending, rok, cfeat,
                                   sinks, n_rep, H, L, D, FH, DV, BL, BD, BF, BV, LOWP, EPS, RW, WS, False, KF)  # fmt: skip
        else:
            _errors_program(r, c, linear, errs, cmap, cvals, cvalid, cpos, lmap, lvals, lpos, wk, bk, recall, pending, rok, lrec,
                            ring, ring_n, qphi, rbuf, sinks, n_rep, H, L, D, FH, DV, BL, BD, BF, BV, LOWP, EPS, KEEP, RW, K, WS)  # fmt: skip
    tl.debug_barrier()  # the errors, the leaving token's recall and the query's read are stored before the commit loads them
    _commit_program(r, linear, errs, qphi, q, out, rbuf, held, ckeys, cmap, cvals, cvalid, cpos, lkeys, lmap, lvals, lvalid,
                    lpos, wkeys, wvals, wvalid, wmap, windex, wk, bk, factor, recall, pending, rok, lrec, ring, ring_n, cfeat, sinks, n_rep, scale,
                    weight_tokens, H, L, D, FH, DV, ETA, BL, BS, BD, BF, BV, BW, BDV, LOWP, EPS, SEPARATE, READ_STATE, READ_SPARSE,
                    KEEP, RW, K, WS, KF, False)  # fmt: skip


# ----------------------------------------------------------------------------- chunked prefill


@triton.jit
def _product_left(a, b, LOWP: tl.constexpr):
    """a (R, K) float32 @ b (K, N) exact in bfloat16 (LOWP), in float32: as (a's bfloat16 part + the
    rest) x b on tensor cores; else in float32."""
    if LOWP:
        hi, lo = _split(a)
        return tl.dot(hi, b.to(tl.bfloat16)) + tl.dot(lo, b.to(tl.bfloat16))
    else:
        return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _exact(a, b, LOWP: tl.constexpr):
    """a (R, K) @ b (K, N), both exact in the model's dtype, in float32."""
    if LOWP:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    else:
        return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _recall_errors(kphi, v, frow, vrow, tok, val, base, zbase, st_r, z_r, sinks, R: tl.constexpr, F: tl.constexpr, DV: tl.constexpr,
                   BF: tl.constexpr, BV: tl.constexpr, LOWP: tl.constexpr, EPS: tl.constexpr, RESIDENT: tl.constexpr):  # fmt: skip
    """Self-recall errors (R,) float32 of the tokens ``tok`` (features at kphi row frow + tok, values
    at v row vrow + tok) against [S | z] at ``base`` / ``zbase``, or, RESIDENT, held in registers as
    ``st_r`` (BF, BV) and ``z_r`` (BF,) (one tile: BF >= F, BV >= DV, zero past them): sinks +inf,
    not ``val`` -inf."""
    nrm = tl.zeros([R], dtype=tl.float32)
    err2 = tl.zeros([R], dtype=tl.float32)
    for v0 in tl.static_range(0, DV, BV):
        ov = v0 + tl.arange(0, BV)
        mv = ov < DV
        acc = tl.zeros([R, BV], dtype=tl.float32)
        for f0 in tl.static_range(0, F, BF):
            of = f0 + tl.arange(0, BF)
            mf = of < F
            kf = tl.load(kphi + (frow + tok)[:, None] * F + of[None, :], mask=val[:, None] & mf[None, :], other=0.0).to(tl.float32)
            if RESIDENT:
                st = st_r
            else:
                st = tl.load(base + of[:, None] * DV + ov[None, :], mask=mf[:, None] & mv[None, :], other=0.0)
            acc += _product(kf, st, LOWP)
            if v0 == 0:
                if RESIDENT:
                    z = z_r
                else:
                    z = tl.load(zbase + of, mask=mf, other=0.0)
                nrm += tl.sum(kf * z[None, :], axis=1)
        ok = nrm > EPS
        vv = tl.load(v + (vrow + tok)[:, None] * DV + ov[None, :], mask=val[:, None] & mv[None, :], other=0.0).to(tl.float32)
        diff = tl.where(ok[:, None], acc / tl.where(ok, nrm, 1.0)[:, None], 0.0) - vv
        diff = tl.where(mv[None, :], diff, 0.0)
        err2 += tl.sum(diff * diff, axis=1)
    e = tl.where(tok < sinks, float("inf"), tl.sqrt(err2))
    return tl.where(val, e, float("-inf"))


@triton.jit
def _older_block(kx, v, row, ki, tok_i, tok_j, val_j, m, l, acc, scale, D: tl.constexpr, BD: tl.constexpr,
                 DV: tl.constexpr, BDV: tl.constexpr, LOWP: tl.constexpr):  # fmt: skip
    """One block of candidates j into the online softmax of the rows i (keys ``ki``): only those
    valid and older than i count (``row``: the KV head's first token in ``kx`` and ``v``). Returns
    the new (max, sum, weighted values)."""
    od = tl.arange(0, BD)
    odv = tl.arange(0, BDV)
    tj = tl.where(val_j, tok_j, 0)
    kj = tl.load(kx + (row + tj)[:, None] * D + od[None, :], mask=val_j[:, None] & (od < D)[None, :], other=0.0)
    s = _exact(ki, tl.trans(kj), LOWP) * scale
    s = tl.where(val_j[None, :] & (tok_j[None, :] < tok_i[:, None]), s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
    alpha = tl.exp(m - m_safe)
    p = tl.exp(s - m_safe[:, None])
    vj = tl.load(v + (row + tj)[:, None] * DV + odv[None, :], mask=val_j[:, None] & (odv < DV)[None, :], other=0.0)
    return m_new, l * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + _product_left(p, vj, LOWP)


@triton.jit
def _older_recall(kx, v, row, prev, p0, n, tok_i, val_i, scale, R: tl.constexpr, LAM: tl.constexpr, BL: tl.constexpr,
                  BC: tl.constexpr, ETA: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, DV: tl.constexpr, BDV: tl.constexpr,
                  LOWP: tl.constexpr):  # fmt: skip
    """Recall errors (R,) float32 of the candidates ``tok_i`` against the older candidates (the
    cache before the chunk at ``prev``, then the chunk's leavers): || softmax(k_i . k_j scale) v - v_i ||
    over the j older than i, +inf where there is none (``ops.lola.older_recall_error``)."""
    od = tl.arange(0, BD)
    odv = tl.arange(0, BDV)
    ti = tl.where(val_i, tok_i, 0)
    ki = tl.load(kx + (row + ti)[:, None] * D + od[None, :], mask=val_i[:, None] & (od < D)[None, :], other=0.0)
    m = tl.full([R], float("-inf"), tl.float32)
    l = tl.zeros([R], dtype=tl.float32)
    acc = tl.zeros([R, BDV], dtype=tl.float32)
    for c0 in tl.static_range(0, LAM, BL):
        cj = c0 + tl.arange(0, BL)
        tok_j = tl.load(prev + cj, mask=cj < LAM, other=-1).to(tl.int64)
        m, l, acc = _older_block(kx, v, row, ki, tok_i, tok_j, tok_j >= 0, m, l, acc, scale, D, BD, DV, BDV, LOWP)
    ob = tl.arange(0, BC)
    tok_j = p0 - ETA + ob
    m, l, acc = _older_block(kx, v, row, ki, tok_i, tok_j, (ob < n) & (tok_j >= 0), m, l, acc, scale, D, BD, DV, BDV, LOWP)
    has = l > 0
    vi = tl.load(v + (row + ti)[:, None] * DV + odv[None, :], mask=val_i[:, None] & (odv < DV)[None, :], other=0.0).to(tl.float32)
    diff = tl.where((odv < DV)[None, :], acc / tl.where(has, l, 1.0)[:, None] - vi, 0.0)
    return tl.where(has, tl.sqrt(tl.sum(diff * diff, axis=1)), float("inf"))


@triton.jit
def lola_select_kernel(
    v, kphi, kx, n_real, lin, zs, held_buf, hist, lkept, nread, errs, wlist, snap, snapz,
    t_len, n_chunks, c_first, c_last, n_seg, sinks, n_rep, scale,
    H: tl.constexpr, F: tl.constexpr, DV: tl.constexpr, ETA: tl.constexpr, C: tl.constexpr, LAM: tl.constexpr,
    BC: tl.constexpr, BL: tl.constexpr, BN: tl.constexpr, BF: tl.constexpr, BV: tl.constexpr, LOWP: tl.constexpr,
    EPS: tl.constexpr, SNAP: tl.constexpr, CH0: tl.constexpr, CH1: tl.constexpr,
    MEMORY: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, BM: tl.constexpr, RESIDENT: tl.constexpr,
):  # fmt: skip
    """The sequential half of LoLA's chunked prefill for one (row, query head), chunks c_first ..
    c_last - 1 (``ops.lola.lola_attention``'s rule): per chunk the candidates' (the cache, then the
    window's leavers) self-recall errors against [S | z], the lambda largest kept (the stable
    sort's rule: ties to the earlier candidate), the new cache as a list of positions in ``hist``,
    the cache entries not kept written into [S | z] (the state the chunk's queries read, saved in
    ``snap`` / ``snapz`` when SNAP), then the leavers not kept. No query is read here. MEMORY: each
    error is the smaller of that and the older candidates' recall error (keys ``kx``, the feature
    maps' inputs per KV head; blocks of BM candidates). RESIDENT: [S | z] is held in registers
    through the chunks (BF >= F and BV >= DV), loaded before the first and stored after the last,
    instead of read from memory by every block of candidates and by the update."""
    r = tl.program_id(0).to(tl.int64)  # one (batch row, query head)
    b = r // H
    h = r % H
    kr = b * (H // n_rep) + h // n_rep
    NCP: tl.constexpr = LAM + BC  # a candidate row of the scratch: the cache, then the leavers
    base = lin + r * F * DV  # S (F, DV)
    zbase = zs + r * F  # z (F,)
    frow = r * t_len  # first token of this (row, query head) in kphi
    vrow = kr * t_len  # and of its KV head in v
    nr = tl.load(n_real + b).to(tl.int64)
    held = tl.load(held_buf + r)
    ob = tl.arange(0, BC)
    oa = tl.arange(0, BN)
    o16 = tl.arange(0, 16).to(tl.int64)
    ofr = tl.arange(0, BF)
    ovr = tl.arange(0, BV)
    mfr = ofr < F
    mr2 = mfr[:, None] & (ovr < DV)[None, :]
    if RESIDENT:
        st_r = tl.load(base + ofr[:, None] * DV + ovr[None, :], mask=mr2, other=0.0)
        z_r = tl.load(zbase + ofr, mask=mfr, other=0.0)
    else:  # unread: [S | z] is read from memory in tiles
        st_r = 0.0
        z_r = 0.0
    # Chunks as constants where Triton's interpreter runs the kernel (it passes runtime scalars as
    # one-element arrays, which NumPy 2 refuses as a loop bound).
    for chunk in range(CH0 if CH1 > 0 else c_first, CH1 if CH1 > 0 else c_last):
        p0 = chunk * C
        n = tl.maximum(tl.minimum(nr - p0, C), 0)
        prev = hist + (r * (n_chunks + 1) + chunk) * LAM  # the cache before the chunk (positions, -1 empty, last)
        new = prev + LAM

        # 1. Every candidate's error against the state before the chunk, into the scratch row.
        for c0 in tl.static_range(0, LAM, BL):
            ci = c0 + tl.arange(0, BL)
            mi = ci < LAM
            tok = tl.load(prev + ci, mask=mi, other=-1).to(tl.int64)
            val = tok >= 0
            e = _recall_errors(kphi, v, frow, vrow, tl.where(val, tok, 0), val, base, zbase, st_r, z_r, sinks, BL, F, DV, BF, BV, LOWP, EPS,
                               RESIDENT)  # fmt: skip
            tl.store(errs + r * NCP + ci, e, mask=mi)
        ltok = p0 - ETA + ob  # the leavers: the window's n oldest slots
        lval = (ob < n) & (ltok >= 0)
        e = _recall_errors(kphi, v, frow, vrow, tl.where(lval, ltok, 0), lval, base, zbase, st_r, z_r, sinks, BC, F, DV, BF, BV, LOWP, EPS,
                           RESIDENT)  # fmt: skip
        tl.store(errs + r * NCP + LAM + ob, e)
        tl.debug_barrier()
        if MEMORY:  # or recalled by the older candidates, whichever is smaller (sinks and empty slots as they are)
            for c0 in tl.static_range(0, LAM + BC, BM):
                ci = c0 + tl.arange(0, BM)
                ctok = tl.load(prev + ci, mask=ci < LAM, other=-1).to(tl.int64)
                tok = tl.where(ci < LAM, ctok, p0 - ETA + ci - LAM)
                val = tl.where(ci < LAM, ctok >= 0, (ci - LAM < n) & (tok >= 0) & (ci < LAM + BC))
                older = _older_recall(kx, v, vrow, prev, p0, n, tok, val, scale, BM, LAM, BL, BC, ETA, D, BD, DV, BDV, LOWP)
                e = tl.load(errs + r * NCP + ci, mask=ci < LAM + BC, other=0.0)
                e = tl.where(val & (tok >= sinks), tl.minimum(e, older), e)
                tl.store(errs + r * NCP + ci, e, mask=ci < LAM + BC)
            tl.debug_barrier()

        # 2. Keep the lambda largest: the lambda-th largest error's key found 4 bits at a time
        # (keys: the float's bits + 1, monotone for errors >= 0 and +inf; 0 for -inf), every key
        # above it kept and, of those equal to it, the earliest candidates.
        ea = tl.load(errs + r * NCP + oa, mask=oa < NCP, other=float("-inf"))
        key = tl.where(ea > float("-inf"), ea.to(tl.int32, bitcast=True).to(tl.int64) + 1, 0)
        thr = tl.full([], 0, tl.int64)
        for sh in tl.static_range(28, -4, -4):
            probe = thr | (o16 << sh)
            cnt = tl.sum((key[:, None] >= probe[None, :]).to(tl.int32), axis=0)
            thr = thr | (tl.max(tl.where(cnt >= LAM, o16, 0), axis=0) << sh)
        above = key > thr
        eq = (key == thr).to(tl.int32)
        need = LAM - tl.sum(above.to(tl.int32), axis=0)
        kept = (above | ((eq != 0) & (tl.cumsum(eq, axis=0) - eq < need))) & (key > 0)
        ctok = tl.load(prev + oa, mask=oa < LAM, other=-1)
        tok_a = tl.where(oa < LAM, ctok, (p0 - ETA + oa - LAM).to(tl.int32))
        ki = kept.to(tl.int32)
        tl.store(new + tl.cumsum(ki, axis=0) - ki, tok_a, mask=kept)
        nk = tl.sum(ki, axis=0)
        tl.store(new + oa, tl.full([BN], -1, tl.int32), mask=(oa < LAM) & (oa >= nk))
        wc = ((oa < LAM) & (ctok >= 0) & (kept == 0)).to(tl.int32)  # cache entries not kept: written first
        tl.store(wlist + r * BC + tl.cumsum(wc, axis=0) - wc, ctok, mask=wc != 0)
        nw = tl.sum(wc, axis=0)
        tl.store(wlist + r * BC + ob, tl.full([BC], -1, tl.int32), mask=ob >= nw)
        tl.store(lkept + (r * n_chunks + chunk) * BC + oa - LAM, ki.to(tl.int8), mask=(oa >= LAM) & (oa < NCP))
        tl.store(nread + r * n_chunks + chunk, (held + nw).to(tl.int32))
        tl.debug_barrier()

        # 3. One pass over [S | z]: the cache entries not kept join it (the state the chunk's
        # queries read, saved), then the leavers not kept.
        wtok = tl.load(wlist + r * BC + ob).to(tl.int64)
        wval = wtok >= 0
        wtok = tl.where(wval, wtok, 0)
        lk = tl.load(lkept + (r * n_chunks + chunk) * BC + ob)
        lw = lval & (lk == 0)
        ltok = tl.where(lw, ltok, 0)
        sv = snap + ((r * n_seg + chunk - c_first) * F) * DV  # this chunk's saved state
        sz = snapz + (r * n_seg + chunk - c_first) * F
        if RESIDENT:
            mvr = ovr < DV
            vc = tl.load(v + (vrow + wtok)[:, None] * DV + ovr[None, :], mask=wval[:, None] & mvr[None, :], other=0.0)
            vl = tl.load(v + (vrow + ltok)[:, None] * DV + ovr[None, :], mask=lw[:, None] & mvr[None, :], other=0.0)
            kc = tl.load(kphi + (frow + wtok)[:, None] * F + ofr[None, :], mask=wval[:, None] & mfr[None, :], other=0.0)
            kl = tl.load(kphi + (frow + ltok)[:, None] * F + ofr[None, :], mask=lw[:, None] & mfr[None, :], other=0.0)
            st_r = st_r + _exact(tl.trans(kc), vc, LOWP)
            z_r = z_r + tl.sum(kc.to(tl.float32), axis=0)
            if SNAP:
                tl.store(sv + ofr[:, None] * DV + ovr[None, :], st_r, mask=mr2)
                tl.store(sz + ofr, z_r, mask=mfr)
            st_r = st_r + _exact(tl.trans(kl), vl, LOWP)
            z_r = z_r + tl.sum(kl.to(tl.float32), axis=0)
        for v0 in tl.static_range(0, DV if not RESIDENT else 0, BV):
            ov = v0 + tl.arange(0, BV)
            mv = ov < DV
            vc = tl.load(v + (vrow + wtok)[:, None] * DV + ov[None, :], mask=wval[:, None] & mv[None, :], other=0.0)
            vl = tl.load(v + (vrow + ltok)[:, None] * DV + ov[None, :], mask=lw[:, None] & mv[None, :], other=0.0)
            for f0 in tl.static_range(0, F, BF):
                of = f0 + tl.arange(0, BF)
                mf = of < F
                m2 = mf[:, None] & mv[None, :]
                kc = tl.load(kphi + (frow + wtok)[:, None] * F + of[None, :], mask=wval[:, None] & mf[None, :], other=0.0)
                kl = tl.load(kphi + (frow + ltok)[:, None] * F + of[None, :], mask=lw[:, None] & mf[None, :], other=0.0)
                ptr = base + of[:, None] * DV + ov[None, :]
                st = tl.load(ptr, mask=m2, other=0.0) + _exact(tl.trans(kc), vc, LOWP)
                if SNAP:
                    tl.store(sv + of[:, None] * DV + ov[None, :], st, mask=m2)
                tl.store(ptr, st + _exact(tl.trans(kl), vl, LOWP), mask=m2)
                if v0 == 0:
                    zc = tl.load(zbase + of, mask=mf, other=0.0) + tl.sum(kc.to(tl.float32), axis=0)
                    if SNAP:
                        tl.store(sz + of, zc, mask=mf)
                    tl.store(zbase + of, zc + tl.sum(kl.to(tl.float32), axis=0), mask=mf)
        held += nw + tl.sum(lw.to(tl.int32), axis=0)
        tl.debug_barrier()
    tl.store(held_buf + r, held)
    if RESIDENT:
        tl.store(base + ofr[:, None] * DV + ovr[None, :], st_r, mask=mr2)
        tl.store(zbase + ofr, z_r, mask=mfr)


@triton.jit
def lola_read_kernel(
    q, k, v, qphi, kphi, n_real, factor, lw, out, hist, lkept, nread, snap, snapz,
    t_len, n_chunks, c_first, n_seg, n_here, sinks, n_rep, scale, weight_tokens,
    H: tl.constexpr, D: tl.constexpr, F: tl.constexpr, DV: tl.constexpr, ETA: tl.constexpr, C: tl.constexpr,
    LAM: tl.constexpr, BC: tl.constexpr, BL: tl.constexpr, BW: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
    BF: tl.constexpr, BQ: tl.constexpr, LOWP: tl.constexpr, EPS: tl.constexpr, READ_STATE: tl.constexpr,
    READ_SPARSE: tl.constexpr,
):  # fmt: skip
    """The parallel half: the output of BQ of a chunk's queries for one (row, query head), from what
    ``lola_select_kernel`` left: each query's true window and the chunk's new cache entries older
    than it exactly (one running max, the window factor), the saved state and the leavers written
    that have left its window linearly (the length weight counting what it reads). Program pid reads
    queries (pid % (BC / BQ)) * BQ.. of chunk c_first + pid / (BC / BQ) % n_here of (row, query
    head) pid / (BC / BQ) / n_here: the programs of one chunk are neighbours in the launch order, so
    its saved state comes from memory once and from L2 after."""
    NQ: tl.constexpr = BC // BQ
    pid = tl.program_id(0)
    q0 = (pid % NQ) * BQ  # the first of this program's queries in the chunk
    chunk = c_first + (pid // NQ) % n_here
    r = (pid // NQ // n_here).to(tl.int64)  # one (batch row, query head)
    b = r // H
    h = r % H
    kr = b * (H // n_rep) + h // n_rep
    qrow = r * t_len
    krow = kr * t_len
    p0 = chunk * C
    n = tl.maximum(tl.minimum(tl.load(n_real + b).to(tl.int64) - p0, C), 0)
    ob = tl.arange(0, BC)
    od = tl.arange(0, BD)
    md = od < D
    odv = tl.arange(0, BDV)
    mdv = odv < DV
    oq = q0 + tl.arange(0, BQ)
    qtok = p0 + oq
    qval = oq < n
    qtok = tl.where(qval, qtok, 0)
    first = qtok - ETA + 1  # the oldest position of each query's window

    # The exact read.
    qx = tl.load(q + (qrow + qtok)[:, None] * D + od[None, :], mask=qval[:, None] & md[None, :], other=0.0)
    ow = tl.arange(0, BW)
    wpos = p0 + q0 - ETA + ow  # the window before the first query, then the queries
    wreal = (ow < ETA + BQ) & (wpos < p0 + n) & (wpos >= 0)
    wtk = tl.where(wreal, wpos, 0)
    kw = tl.load(k + (krow + wtk)[:, None] * D + od[None, :], mask=wreal[:, None] & md[None, :], other=0.0)
    s = _exact(qx, tl.trans(kw), LOWP) * scale
    okw = wreal[None, :] & (wpos[None, :] >= first[:, None]) & (wpos[None, :] <= qtok[:, None]) & qval[:, None]
    s = tl.where(okw, s, float("-inf"))
    m = tl.max(s, axis=1)
    m = tl.where(m > float("-inf"), m, 0.0)
    p = tl.exp(s - m[:, None])
    vw = tl.load(v + (krow + wtk)[:, None] * DV + odv[None, :], mask=wreal[:, None] & mdv[None, :], other=0.0)
    acc = _product_left(p, vw, LOWP)
    den = tl.sum(p, axis=1)
    if READ_SPARSE:
        cache = hist + (r * (n_chunks + 1) + chunk + 1) * LAM  # the cache after the chunk's choice
        for c0 in tl.static_range(0, LAM, BL):
            oc = c0 + tl.arange(0, BL)
            ctok = tl.load(cache + oc, mask=oc < LAM, other=-1).to(tl.int64)
            cval = ctok >= 0
            ctk = tl.where(cval, ctok, 0)
            kc = tl.load(k + (krow + ctk)[:, None] * D + od[None, :], mask=cval[:, None] & md[None, :], other=0.0)
            sc = _exact(qx, tl.trans(kc), LOWP) * scale
            sc = tl.where(cval[None, :] & (ctok[None, :] < first[:, None]) & qval[:, None], sc, float("-inf"))
            m_new = tl.maximum(m, tl.max(sc, axis=1))
            alpha = tl.exp(m - m_new)
            pc = tl.exp(sc - m_new[:, None])
            vc = tl.load(v + (krow + ctk)[:, None] * DV + odv[None, :], mask=cval[:, None] & mdv[None, :], other=0.0)
            acc = acc * alpha[:, None] + _product_left(pc, vc, LOWP)
            den = den * alpha + tl.sum(pc, axis=1)
            m = m_new
    f = tl.load(factor + h)
    num = f * acc
    den = f * den

    if READ_STATE:  # LoLCATs convention: the linear term is not rescaled by exp(-m)
        ltok = p0 - ETA + ob  # the leavers (window slot ob)
        lk = tl.load(lkept + (r * n_chunks + chunk) * BC + ob)
        lval = (ob < n) & (ltok >= 0) & (lk == 0)  # written into the state
        ltok = tl.where(lval, ltok, 0)
        gone = (ltok[None, :] < first[:, None]) & lval[None, :]  # (query, leaver) written and out of the window
        sv = snap + ((r * n_seg + chunk - c_first) * F) * DV
        sz = snapz + (r * n_seg + chunk - c_first) * F
        lin_num = tl.zeros([BQ, BDV], dtype=tl.float32)
        lin_den = tl.zeros([BQ], dtype=tl.float32)
        a = tl.zeros([BQ, BC], dtype=tl.float32)  # phi(q_i) . phi(k_s), query i, leaver s
        for f0 in tl.static_range(0, F, BF):
            of = f0 + tl.arange(0, BF)
            mf = of < F
            qf = tl.load(qphi + (qrow + qtok)[:, None] * F + of[None, :], mask=qval[:, None] & mf[None, :], other=0.0)
            kl = tl.load(kphi + (qrow + ltok)[:, None] * F + of[None, :], mask=lval[:, None] & mf[None, :], other=0.0)
            st = tl.load(sv + of[:, None] * DV + odv[None, :], mask=mf[:, None] & mdv[None, :], other=0.0)
            lin_num += _product(qf.to(tl.float32), st, LOWP)
            lin_den += tl.sum(qf.to(tl.float32) * tl.load(sz + of, mask=mf, other=0.0)[None, :], axis=1)
            a += _exact(qf, tl.trans(kl), LOWP)
        n_read = tl.load(nread + r * n_chunks + chunk) + tl.sum(gone.to(tl.int32), axis=1)
        lf = tl.minimum(weight_tokens / tl.maximum(n_read, 1).to(tl.float32), 1.0)
        wt = tl.load(lw + h) * tl.where(weight_tokens > 0, lf, 1.0)
        a = tl.where(gone, a, 0.0)
        vl = tl.load(v + (krow + ltok)[:, None] * DV + odv[None, :], mask=lval[:, None] & mdv[None, :], other=0.0)
        lin_num += _product_left(a, vl, LOWP)
        lin_den += tl.sum(a, axis=1)
        num += wt[:, None] * lin_num
        den += wt * lin_den
    o = tl.where(den[:, None] > EPS, num / tl.where(den > EPS, den, 1.0)[:, None], 0.0)
    tl.store(out + (qrow + qtok)[:, None] * DV + odv[None, :], o.to(out.dtype.element_ty), mask=qval[:, None] & mdv[None, :])
