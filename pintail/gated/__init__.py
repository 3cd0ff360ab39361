"""swiglu / geglu: the gated MLP activation act(gate) * up, in one pass each way.

Forward: read gate and up, write act(gate) * up (3 passes of tokens x intermediate).
Backward: read dy, gate and up, recompute act(gate), write dgate = dy * up * act'(gate) and
dup = dy * act(gate) (5 passes); nothing beyond gate and up is saved. act: SiLU,
g * sigmoid(g); GELU with the tanh approximation, 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715
g^3))); GELU, g * Phi(g).
"""

from .api import geglu, swiglu

__all__ = ["geglu", "swiglu"]
