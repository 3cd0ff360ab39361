"""What the losses share, below every one of them: the option, class-weight and target
checks and the reduction (checks.py), the per-row arithmetic as Triton functions (rows.py),
the kernels over a chunk of a row's classes (kernels.py), their launches and the chunk loops
over a head (chunks.py), and the launch tables these take (plans.py). It imports nothing
from the packages above it."""
