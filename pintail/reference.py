"""Plain PyTorch versions of the ops: the CPU path (and float64 anywhere)."""

import math

import torch


def softmax_forward(x, dim, log, out_dtype):
    """In float32 at least, rounded once to out_dtype, as the kernels (torch's dtype= casts the
    input first)."""
    op = torch.log_softmax if log else torch.softmax
    compute = torch.promote_types(torch.promote_types(x.dtype, out_dtype), torch.float32)
    return op(x.to(compute), dim).to(out_dtype)


def softmax_backward(y, dy, dim, log, in_dtype):
    compute = torch.promote_types(y.dtype, torch.float32)
    y, dy = y.to(compute), dy.to(compute)
    if log:
        dx = dy - y.exp() * dy.sum(dim, keepdim=True)
    else:
        dx = y * (dy - (y * dy).sum(dim, keepdim=True))
    return dx.to(in_dtype)


def _capped_logits(x, softcap):
    """(x in float32 at least, softcapped if asked; tanh(x / softcap) or None)."""
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    if softcap <= 0:
        return x, None
    tanh = torch.tanh(x / softcap)
    return softcap * tanh, tanh


def _shift(row_max):
    """What a row's logits are shifted by: its max, or 0 where every logit is -inf."""
    return torch.where(row_max == -float("inf"), 0, row_max)[:, None]


def _class_rows(target, ignore_index, V):
    """(ignored rows, rows whose class index is in [0, V), a safe index for every row)."""
    ignored = target == ignore_index
    in_range = (target >= 0) & (target < V)
    return ignored, in_range, torch.where(in_range & ~ignored, target, 0).long()


def cross_entropy_rows(x, target, weight, ignore_index, smoothing, z_scale, softcap, prob_target):
    """Per-row (loss, (max, log-sum) pairs, target mass) of logits x[M, V], as pintail's
    cross-entropy kernels produce them (see pintail/cross_entropy/__init__.py for the formulas)."""
    x, _ = _capped_logits(x, softcap)
    compute, V = x.dtype, x.shape[1]
    row_max = x.max(1).values if V else x.new_zeros(x.shape[0])
    shifted = x - _shift(row_max)
    log_sum = torch.logsumexp(shifted, dim=1)
    lse = row_max + log_sum
    stats = torch.stack([row_max, log_sum], 1)
    logp = shifted - log_sum[:, None]
    w = weight.to(compute) if weight is not None else torch.ones(V, dtype=compute, device=x.device)
    if prob_target:
        y = ((1 - smoothing) * target.to(compute) + smoothing / V) * w
        return -torch.where(y != 0, y * logp, 0).sum(1) + z_scale * lse**2, stats, y.sum(1)
    ignored, in_range, safe = _class_rows(target, ignore_index, V)
    if V == 0:  # no class: every kept row's target is out of range
        loss = torch.where(ignored, 0.0, torch.full_like(lse, float("nan")))
        return loss, stats, x.new_empty(0)
    loss = -(1 - smoothing) * w[safe] * logp.gather(1, safe[:, None])[:, 0] + z_scale * lse**2
    if smoothing > 0:
        loss = loss - smoothing / V * torch.where(w != 0, logp * w, 0).sum(1)  # 0 * log 0 = 0, as the kernels
    loss = torch.where(ignored, 0.0, loss)
    loss = torch.where(in_range | ignored, loss, float("nan"))
    # the kernels' mass output: W = sum of the weights a row, where smoothing spreads over them
    mass = w.sum().repeat(x.shape[0]) if weight is not None and smoothing > 0 else x.new_empty(0)
    return loss, stats, mass


def cross_entropy_rows_backward(grad, x, target, weight, stats, ignore_index, smoothing, z_scale, softcap,
                                prob_target):
    """dloss/dx of cross_entropy_rows, given the gradient of each row's loss, by the formulas
    of pintail/cross_entropy/__init__.py (plain tensor math: a custom op may not run autograd inside)."""
    M, V = x.shape
    if V == 0:
        return x.new_empty(M, 0)
    xc, tanh = _capped_logits(x, softcap)
    compute = xc.dtype
    stats = stats.to(compute)
    row_max, log_sum = stats[:, 0], stats[:, 1]
    lse = row_max + log_sum
    p = torch.exp((xc - _shift(row_max)) - log_sum[:, None])  # x - max exact
    w = weight.to(compute) if weight is not None else torch.ones(V, dtype=compute, device=x.device)
    if prob_target:
        y = ((1 - smoothing) * target.to(compute) + smoothing / V) * w
        dx = p * (y.sum(1) + 2 * z_scale * lse)[:, None] - y
    else:
        ignored, in_range, safe = _class_rows(target, ignore_index, V)
        w_t = (1 - smoothing) * w[safe]
        dx = p * (w_t + smoothing / V * w.sum() + 2 * z_scale * lse)[:, None]
        if smoothing > 0:
            dx = dx - smoothing / V * w
        dx = dx.scatter_add(1, safe[:, None], -w_t[:, None].expand(M, 1))
    dx = dx * grad.to(compute)[:, None]
    if tanh is not None:
        dx = dx * (1 - tanh * tanh)
    if not prob_target:  # ignored rows: 0, NaN only where their softmax is (whatever the upstream)
        dx = torch.where(ignored[:, None], p * 0, dx)
        dx = torch.where((in_range | ignored)[:, None], dx, float("nan"))
    return dx.to(x.dtype)


def rotary(x, cos, sin, positions, seq_dim, seq_offset, rotary_dim, interleaved, backward):
    """The rotation of pintail/rotary/kernels.py in torch: x * cos + turn(x) * sin on the first
    rotary_dim features; backward: the transpose, y * cos - turn(y * sin)."""
    compute = torch.promote_types(x.dtype, torch.float32)
    xs = x.movedim(seq_dim, 1)  # (B, S, H, D)
    B, S = xs.shape[:2]
    if cos.dim() == 3:
        c, s = cos.expand(B, S, -1), sin.expand(B, S, -1)
    else:
        rows = positions if positions is not None else (torch.arange(S, device=x.device) + seq_offset).expand(B, S)
        c, s = cos[rows], sin[rows]
    if c.shape[-1] != rotary_dim:  # a column per pair: one per feature
        widen = (lambda t: t.repeat_interleave(2, -1)) if interleaved else (lambda t: torch.cat([t, t], -1))
        c, s = widen(c), widen(s)
    c, s = c[:, :, None, :].to(compute), s[:, :, None, :].to(compute)

    def turn(v):
        if interleaved:
            return torch.stack([-v[..., 1::2], v[..., ::2]], -1).flatten(-2)
        first, second = v.chunk(2, -1)
        return torch.cat([-second, first], -1)

    v = xs[..., :rotary_dim].to(compute)
    out = v * c - turn(v * s) if backward else v * c + turn(v) * s
    return torch.cat([out.to(x.dtype), xs[..., rotary_dim:]], -1).movedim(1, seq_dim)


def norm_forward(x, residual, weight, bias, eps, weight_offset, rms, out_dtype):
    """(y, h, mean, rstd) of pintail.norm's kernels in torch, for rows x[M, N]."""
    h = x + residual if residual is not None else x.new_empty(0, x.shape[1], dtype=out_dtype)  # fresh, not a view
    held = h if residual is not None else x
    v = held.to(torch.promote_types(held.dtype, torch.float32))
    mean = v.new_empty(0) if rms else v.mean(1)  # RMS: not kept
    centred = v if rms else v - mean[:, None]
    rstd = torch.rsqrt(centred.square().mean(1) + eps)
    y = centred * rstd[:, None]
    if weight is not None:
        y = y * (weight.to(v.dtype) + weight_offset)
    if bias is not None:
        y = y + bias.to(v.dtype)
    return y.to(out_dtype), h, mean, rstd


def norm_backward(dy, dh, x, weight, has_bias, mean, rstd, weight_offset, rms, x_dtype):
    """(dx, dweight, dbias) of norm_forward, x being the normalised input (h with a residual)."""
    compute = torch.promote_types(x.dtype, torch.float32)
    x_hat = (x.to(compute) if rms else x.to(compute) - mean[:, None]) * rstd[:, None]
    dy = dy.to(compute)
    g = dy * (weight.to(compute) + weight_offset) if weight is not None else dy
    dx = g - x_hat * (g * x_hat).mean(1, keepdim=True)
    if not rms:
        dx = dx - g.mean(1, keepdim=True)
    dx = dx * rstd[:, None]
    if dh is not None:
        dx = dx + dh.to(compute)
    dw = (dy * x_hat).sum(0) if weight is not None else None
    db = dy.sum(0) if has_bias else None
    return dx.to(x_dtype), dw, db


def linear_cross_entropy_fold(chunk, first_class, V, target, weight, weight_total, state, loss, stats, ignore_index,
                              smoothing, z_scale, softcap, first, last):
    """linear_cross_entropy's fold kernel in torch: the logits of classes first_class ... of
    every row (chunk) folded into its running state (max, sum of exp(x - max), 0, sum_j v_j
    x_j, target logit; v the class weights for smoothing, else 1); the last chunk writes each
    row's loss and (max, log-sum) pair instead (cross_entropy_rows' formulas)."""
    x, _ = _capped_logits(chunk, softcap)
    x = x.to(state.dtype)
    n = x.shape[1]
    if first:
        state[:, 0], state[:, 1:] = -float("inf"), 0
    running_max, running_sum = state[:, 0], state[:, 1]
    new_max = torch.maximum(running_max, x.max(1).values)
    shift = _shift(new_max)
    running_sum = running_sum * torch.exp(running_max - shift[:, 0]) + torch.exp(x - shift).sum(1)
    v = weight[first_class:first_class + n].to(x.dtype) if weight is not None else torch.ones_like(x[0])
    weighted = state[:, 3] + torch.where(v != 0, v * x, 0).sum(1)
    at = target.long() - first_class
    hit = (at >= 0) & (at < n)
    target_x = torch.where(hit, x.gather(1, torch.where(hit, at, 0)[:, None])[:, 0], state[:, 4])
    if not last:
        state[:, 0], state[:, 1], state[:, 3], state[:, 4] = new_max, running_sum, weighted, target_x
        return
    log_sum = torch.log(running_sum)
    lse = new_max + log_sum
    ignored, in_range, safe = _class_rows(target, ignore_index, V)
    w_t = weight.to(x.dtype)[safe] if weight is not None else 1.0
    rows = (1 - smoothing) * w_t * ((new_max - target_x) + log_sum) + z_scale * lse**2
    if smoothing > 0:
        total = weight_total if weight_total is not None else V
        rows = rows + smoothing / V * (total * lse - weighted)
    rows = torch.where(ignored, 0.0, rows)
    loss.copy_(torch.where(in_range | ignored, rows, float("nan")))
    stats.copy_(torch.stack([new_max, log_sum], 1))


def linear_cross_entropy_chunk_gradient(chunk, first_class, V, target, weight, weight_total, stats, grad,
                                        ignore_index, smoothing, z_scale, softcap):
    """The gradient of each row's loss, times grad[row], with respect to the logits of classes
    first_class ... (chunk), in chunk's dtype (cross_entropy_rows_backward over a chunk)."""
    xc, tanh = _capped_logits(chunk, softcap)
    xc = xc.to(stats.dtype)
    M, n = xc.shape
    row_max, log_sum = stats[:, 0], stats[:, 1]
    p = torch.exp((xc - _shift(row_max)) - log_sum[:, None])
    ignored, in_range, safe = _class_rows(target, ignore_index, V)
    w_t = (1 - smoothing) * (weight.to(xc.dtype)[safe] if weight is not None else torch.ones_like(row_max))
    total = weight_total if weight_total is not None else V
    d = p * (w_t + smoothing / V * total + 2 * z_scale * (row_max + log_sum))[:, None]
    if smoothing > 0:
        d = d - smoothing / V * (weight[first_class:first_class + n].to(xc.dtype) if weight is not None else 1.0)
    at = safe - first_class
    hit = (at >= 0) & (at < n)
    d = d.scatter_add(1, torch.where(hit, at, 0)[:, None], -(w_t * hit)[:, None])
    d = d * grad.to(xc.dtype)[:, None]
    if tanh is not None:
        d = d * (1 - tanh.to(xc.dtype) ** 2)
    d = torch.where(ignored[:, None], p * 0, d)
    return torch.where((in_range | ignored)[:, None], d, float("nan")).to(chunk.dtype)


def _gated_activation(g, activation):
    """act(g) for the gated activations' codes: 0 SiLU, 1 GELU (tanh), 2 GELU (erf)."""
    if activation == 0:
        return torch.nn.functional.silu(g)
    return torch.nn.functional.gelu(g, approximate="tanh" if activation == 1 else "none")


def gated_forward(gate, up, activation):
    """act(gate) * up in float32 at least, rounded once to gate's dtype, as the kernel."""
    compute = torch.promote_types(gate.dtype, torch.float32)
    return (_gated_activation(gate.to(compute), activation) * up.to(compute)).to(gate.dtype)


def gated_backward(dy, gate, up, activation):
    """(dy * up * act'(gate), dy * act(gate)) in float32 at least, in gate's dtype (the
    derivatives written out: a custom op may not run autograd inside)."""
    compute = torch.promote_types(gate.dtype, torch.float32)
    g, dy, up = gate.to(compute), dy.to(compute), up.to(compute)
    if activation == 0:
        s = torch.sigmoid(g)
        a, da = g * s, s * (1 + g * (1 - s))
    elif activation == 1:
        k, c = math.sqrt(2 / math.pi), 0.044715
        t = torch.tanh(k * (g + c * g**3))
        a, da = 0.5 * g * (1 + t), 0.5 * (1 + t) + 0.5 * g * (1 - t * t) * k * (1 + 3 * c * g * g)
    else:
        cdf = 0.5 * (1 + torch.erf(g / math.sqrt(2)))
        a, da = g * cdf, cdf + g * torch.exp(-0.5 * g * g) / math.sqrt(2 * math.pi)
    return (dy * up * da).to(gate.dtype), (dy * a).to(gate.dtype)


def log_probs_rows(x, target, ignore_index, temperature, softcap, entropy, lp, H, stats, first_class=0,
                   num_classes=None):
    """log_probs' kernel in torch: into lp (M,), H (M,) where entropy, stats (M, 2) of x (M, V);
    lp None: x holds classes first_class ... of num_classes, and stats (M, 4) gets each row's
    (max, sum of exp, entropy sum, z_t or 0)."""
    V = x.shape[1]
    num_classes = V if num_classes is None else num_classes
    z = _capped_logits(x, softcap)[0] / temperature
    row_max = z.max(1).values
    shifted = z - _shift(row_max)
    terms = shifted.exp()
    ignored, in_range, _ = _class_rows(target, ignore_index, num_classes)
    at = target.long() - first_class
    here = (at >= 0) & (at < V) & ~ignored
    z_t = torch.where(here, z.gather(1, torch.where(here, at, 0)[:, None])[:, 0], 0.0)
    if lp is None:
        moment = torch.where(terms > 0, terms * shifted, 0.0).sum(1)
        stats.copy_(torch.stack([row_max, terms.sum(1), moment, z_t], 1))
        return
    log_sum = terms.sum(1).log()
    kept, bad = in_range & ~ignored, ~in_range & ~ignored
    lp.copy_(torch.where(bad, float("nan"), torch.where(kept, (z_t - row_max) - log_sum, 0.0)))
    stats.copy_(torch.stack([row_max, log_sum], 1))
    if entropy:
        log_p = shifted - log_sum[:, None]
        rows = -torch.where(log_p > -float("inf"), log_p.exp() * log_p, 0.0).sum(1)
        H.copy_(torch.where(bad, float("nan"), torch.where(kept, rows, 0.0)))


def log_probs_rows_backward(grad_lp, grad_H, x, target, stats, H, ignore_index, temperature, softcap, entropy,
                            first_class=0, num_classes=None):
    """log_probs' backward kernel in torch: d(lp, H)/dx times the rows' gradients, float32
    at least; x holds classes first_class ... of num_classes."""
    V = x.shape[1]
    num_classes = V if num_classes is None else num_classes
    capped, tanh = _capped_logits(x, softcap)
    log_p = (capped / temperature - stats[:, :1]) - stats[:, 1:]
    p = log_p.exp()
    ignored, in_range, _ = _class_rows(target, ignore_index, num_classes)
    kept, bad = in_range & ~ignored, ~in_range & ~ignored
    keep = torch.where(bad, float("nan"), kept.to(p.dtype))[:, None]
    g_lp = grad_lp.to(p.dtype)[:, None] * keep
    d = -g_lp * p
    at = target.long() - first_class
    here = (at >= 0) & (at < V) & kept
    d.scatter_add_(1, torch.where(here, at, 0)[:, None], torch.where(here[:, None], g_lp, 0.0))
    if entropy:
        d -= grad_H.to(p.dtype)[:, None] * keep * torch.where(p > 0, p * (log_p + H[:, None]), 0.0)
    d = d / temperature
    return d * (1 - tanh * tanh) if tanh is not None else d


def distillation_rows(s, t, target, ignore_index, beta, temperature, grad=None):
    """The distillation kernel in torch: each row's loss of student logits s and teacher
    logits t (M, V), float32 at least; with grad (M,) also writes the gradient over s."""
    compute = torch.promote_types(s.dtype, torch.float32)
    lp_s = torch.log_softmax(s.to(compute) / temperature, -1)
    lp_t = torch.log_softmax(t.to(compute) / temperature, -1)
    p_s, p_t = lp_s.exp(), lp_t.exp()

    def term(p, log_ratio):
        return torch.where(p > 0, p * log_ratio, 0.0)

    if beta == 0:
        rows = term(p_t, lp_t - lp_s).sum(-1)
        d = p_s - p_t
    elif beta == 1:
        rows = term(p_s, lp_s - lp_t).sum(-1)
        d = term(p_s, lp_s - lp_t) - p_s * rows[:, None]
    else:
        lm = torch.logaddexp(lp_t + math.log(beta), lp_s + math.log(1 - beta))
        student = (1 - beta) * term(p_s, lp_s - lm)
        rows = beta * term(p_t, lp_t - lm).sum(-1) + student.sum(-1)
        d = student - p_s * student.sum(-1, keepdim=True)
    kept = target != ignore_index if target is not None else torch.ones_like(rows, dtype=torch.bool)
    if grad is not None:
        s.copy_(d * (torch.where(kept, grad.to(compute), 0.0) / temperature)[:, None])
    return torch.where(kept, rows, 0.0)
