"""Print the README's table of model families from pintail.transformers.FAMILIES.

    python tools/family_table.py            # the markdown table
    python tools/family_table.py --check    # exit 1 if README.md's table differs
"""

import argparse
import sys
from pathlib import Path

from pintail.transformers import FAMILIES

README = Path(__file__).resolve().parent.parent / "README.md"
HEADER = ["model_type", "norms", "residual add in the norm", "rotary", "gated MLP", "loss", "stays torch's"]
WORDS = {
    "cast_then_weight": "cast, then weight", "weight_then_cast": "weight, then cast",
    "one_plus_weight": "1 + weight",
    "optional_weight": "weight if any", "unweighted": "no weight", "layer_norm": "LayerNorm",
    "layer_norm_one_plus": "LayerNorm, 1 + weight", "gated": "gated by SiLU",
    "pre": "pre-norm", "pre_mlp_pair": "pre-norm", "pre_dropout": "pre-norm, dropouts",
    "pre_scaled": "pre-norm, scaled",
    "sandwich": "sandwich", "sandwich_glm": "sandwich",
    "half": "halves", "half_width": "halves, half-width angles", "interleaved": "interleaved pairs",
    "interleaved_columns": "interleaved pairs", "interleaved_tail": "interleaved pairs, last features",
    "complex": "interleaved pairs (complex angles)",
    "silu separate": "SwiGLU", "silu fused": "SwiGLU, one gate_up", "gelu separate": "GeGLU",
    "gelu_tanh separate": "GeGLU (tanh)", "gelu_tanh fused": "GeGLU (tanh), one gate_up",
    "silu experts": "SwiGLU experts",
}


def _rules(parts):
    return ", ".join(sorted({WORDS.get(rule, rule) for rule in parts.values()})) or "-"


def table():
    rows = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for model_type, entry in FAMILIES.items():
        kept = ", ".join(sorted({what.split()[0] for what in entry["torch"]})) or "-"
        rows.append("| " + " | ".join([f"`{model_type}`", _rules(entry["norms"]), _rules(entry["residual"]),
                                       _rules(entry["rotary"]), _rules(entry["mlp"]), entry["loss"] or "-", kept])
                    + " |")
    return "\n".join(rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with README.md's table")
    args = parser.parse_args()
    text = table()
    if args.check:
        if text not in README.read_text():
            print("README.md's family table differs from pintail.transformers.FAMILIES; run tools/family_table.py")
            return 1
        return 0
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
