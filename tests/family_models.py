"""Tiny, randomly initialised Hugging Face models, one per model family, built from the
family's own config class with small sizes: the causal-LM class, or for vision-language
families the conditional-generation class; and a batch whose forward gives a loss.

    model = tiny_model("qwen3")
    loss = model(**tiny_inputs("qwen3", model)).loss
    model = tiny_model("qwen2_vl")
    loss = model(**tiny_inputs("qwen2_vl", model, images=True)).loss
"""

import copy
import dataclasses
import inspect

import torch
import transformers
from transformers import AutoConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
)

VOCAB = 256
EXPERTS = 4
TEXT_IDS = (3, 240)  # ordinary tokens; 0-2 are pad/bos/eos and the top of the vocabulary is for image markers

# Given to every text config that has the field (or an alias of it in attribute_map).
TEXT = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=128, original_max_position_embeddings=128,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
    # MoE, under each family's own names: 4 experts, top-2, experts 32 wide
    num_experts=EXPERTS, num_local_experts=EXPERTS, n_routed_experts=EXPERTS,
    num_experts_per_tok=2, moe_topk=2, top_k_experts=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
)

# Given to every vision config: a 16x16 image in 4x4 patches (16 patches, 4 tokens after a 2x2 merge).
VISION = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
    head_dim=16, image_size=16, patch_size=4, spatial_merge_size=2, temporal_patch_size=2,
    embed_dim=64, depth=2, num_heads=4, out_hidden_size=64, num_position_embeddings=16,
)

IMAGE_TOKENS = 4  # image tokens per image in every family unless its entry says otherwise
GRID = (1, 4, 4)  # (t, h, w) patches of one image for the families that take flattened patches

# a sliding window shorter than the batch's sequences, and a full-attention layer
SLIDING = dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"])
GEMMA3 = dict(SLIDING, query_pre_attn_scalar=16)  # queries scaled by head_dim ** -0.5, as in the checkpoints
# Gemma 4's full-attention layers have wider heads (global_head_dim) and a partial "proportional"
# rotary; every layer also takes a slice of a per-layer embedding table
GEMMA4 = dict(SLIDING, global_head_dim=32, vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16)
# one linear-attention (gated delta net) layer and one full-attention layer
LINEAR = dict(layer_types=["linear_attention", "full_attention"], linear_key_head_dim=16,
              linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4)


def mrope(section, **rope):
    """M-RoPE: `section` splits the rotary frequencies (half the rotated dims) among t, h, w."""
    return dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=section, **rope))


# head_dim 32 keeps the family's 0.25 partial rotary at 8 rotated dims, 4 frequencies
QWEN3_5 = dict(LINEAR, head_dim=32, **mrope([2, 1, 1], partial_rotary_factor=0.25, mrope_interleaved=True))


# Per family: "text", "vision", "top" (the composite config) override the sizes above;
# "images" names the form of the image inputs (see _image_inputs), "image_tokens" their count;
# "revive" names tensors a checkpoint fills but the init leaves at zero, which would cut a path
# off the loss (the image path, or all but one expert): they get random values.
FAMILIES = {
    "granite": {"text": dict(  # Granite 3's multipliers, so that a patch that drops one shows
        embedding_multiplier=12.0, logits_scaling=8.0, residual_multiplier=0.22, attention_multiplier=0.0625)},
    "llama": {},
    "smollm3": {"text": dict(no_rope_layers=[1, 0])},  # every 4th layer is NoPE; here the second
    "llava": {"images": "pixels", "top": dict(image_seq_length=IMAGE_TOKENS),
              "vision": dict(image_size=8)},  # CLIP keeps every patch (the CLS dropped): 2x2 patches
    "llama4": {"images": "pixels",
               # layer 0 dense (intermediate_size_mlp), layer 1 MoE; the NoPE layer is the full-attention one
               "text": dict(intermediate_size=32, intermediate_size_mlp=96, interleave_moe_layer_step=2,
                            no_rope_layers=[1, 0], attention_chunk_size=8),
               # pixel shuffle 0.5 quadruples the width the projector MLP takes
               "vision": dict(intermediate_size=256, projector_input_dim=64, projector_output_dim=64,
                              vision_output_dim=64)},
    "mllama": {"images": "tiles", "image_tokens": 1,  # one <|image|> token; layer 1 cross-attends to the tile
               "revive": ("cross_attn_attn_gate", "cross_attn_mlp_gate"),
               "text": dict(cross_attention_layers=[1]),
               "vision": dict(num_global_layers=1, max_num_tiles=1, supported_aspect_ratios=[[1, 1]],
                              intermediate_layers_indices=[0], vision_output_dim=128)},  # hidden * (1 + 1)
    "ministral": {"text": dict(sliding_window=8)},
    "mistral": {},
    "nemotron": {},
    "mixtral": {"text": dict(intermediate_size=32)},  # intermediate_size is the expert width
    "gemma": {},
    "gemma2": {"text": dict(query_pre_attn_scalar=16, sliding_window=8)},  # alternates sliding / full
    "gemma3_text": {"text": GEMMA3},
    "gemma3": {"images": "pixels", "text": GEMMA3, "top": dict(mm_tokens_per_image=IMAGE_TOKENS),
               "vision": dict(vision_use_head=False),  # as Gemma 3's checkpoints: no pooling head
               "revive": ("mm_input_projection_weight",)},
    "gemma4_text": {"text": GEMMA4},
    "gemma4": {"images": "gemma4", "text": GEMMA4,
               "vision": dict(pooling_kernel_size=2, position_embedding_size=16)},  # 2x2 pooling: 4 tokens
    "paligemma": {"images": "pixels", "top": dict(projection_dim=64),
                  "vision": dict(image_size=8)},  # SigLIP keeps every patch: 2x2 patches
    "qwen2": {},
    "qwen3": {},
    "qwen3_moe": {},
    "gpt_oss": {"text": dict(intermediate_size=32, sliding_window=8)},
    "qwen2_vl": {"images": "patches", "text": mrope([2, 3, 3])},
    # windows of 8x8 pixels (one merged 2x2 patch group), the last block attends over the whole image
    "qwen2_5_vl": {"images": "patches", "text": mrope([2, 3, 3]),
                   "vision": dict(window_size=8, fullatt_block_indexes=[1])},
    # Qwen3-VL interleaves the t/h/w frequencies; deepstack adds vision features into the first layer
    "qwen3_vl": {"images": "patches", "text": mrope([4, 2, 2], mrope_interleaved=True),
                 "vision": dict(deepstack_visual_indexes=[0])},
    "qwen3_vl_moe": {"images": "patches", "text": mrope([4, 2, 2], mrope_interleaved=True),
                     "vision": dict(deepstack_visual_indexes=[0])},
    "phi3": {},
    "olmo2": {},
    "olmo3": {"text": SLIDING},
    "glm4": {},
    # GLM-4.1V / 4.5V rotate half of each head
    "glm4v": {"images": "patches", "text": mrope([2, 1, 1], partial_rotary_factor=0.5)},
    "glm4v_moe": {"images": "patches",  # layer 0 dense, layer 1 MoE
                  "text": dict(mrope([2, 1, 1], partial_rotary_factor=0.5), first_k_dense_replace=1)},
    "internvl": {"images": "pixels", "top": dict(image_seq_length=IMAGE_TOKENS),
                 "vision": dict(image_size=(16, 16), patch_size=(4, 4))},
    "smolvlm": {"images": "frames"},
    # the mixer's 64 channels in 4 heads of 16; muP multipliers other than 1
    "falcon_h1": {"text": dict(mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16,
                               mamba_chunk_size=8, lm_head_multiplier=0.5, embedding_multiplier=2.0)},
    "qwen3_next": {"text": LINEAR},
    "qwen3_5": {"images": "patches", "text": QWEN3_5},
    "qwen3_5_moe": {"images": "patches", "text": QWEN3_5},
    "hunyuan_v1_dense": {},
    "hunyuan_v1_moe": {"text": dict(intermediate_size=32)},  # intermediate_size is the expert width
    # one compressed-sparse and one heavily-compressed attention layer (compressing 2 and 4 tokens),
    # hash routing then top-k routing; the family's single kv head
    "deepseek_v4": {"text": dict(
        num_key_value_heads=1, q_lora_rank=32, o_groups=2, o_lora_rank=16, index_n_heads=2, index_head_dim=16,
        index_topk=4, sliding_window=8, partial_rotary_factor=0.5,
        layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
        compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
        mlp_layer_types=["hash_moe", "moe"]),
        "revive": ("tid2eid",)},  # the hash-routing table: token id -> experts
    "exaone4": {"text": SLIDING},
    "gpt2": {"text": dict(n_inner=96)},
    "gpt_neox": {},
}

# the families this transformers knows (all of them on 5.25)
FAMILY_TYPES = tuple(t for t in FAMILIES if t in CONFIG_MAPPING and (
    t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or t in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES))


def is_vision_language(model_type):
    return model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES


def model_class(model_type):
    names = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES if is_vision_language(model_type) \
        else MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return getattr(transformers, names[model_type])


def _fitting(config_class, sizes):
    """The entries of `sizes` that config_class has as a field, aliases (attribute_map) resolved;
    a field named directly wins over an alias of it (deepseek_v4 maps intermediate_size to
    moe_intermediate_size)."""
    fields = {f.name for f in dataclasses.fields(config_class)}
    aliases = getattr(config_class, "attribute_map", {})
    out = {}
    for key, value in sizes.items():
        if key in fields:
            out[key] = value
        elif aliases.get(key) in fields and aliases[key] not in sizes:
            out[aliases[key]] = value
    return out


def _sub_config(composite, key, sizes, overrides):
    spec = composite.sub_configs_defaults[key]
    config_class = spec.get_config_class(spec.model_type) if spec.config_class is AutoConfig else spec.config_class
    # the spec's init_kwargs are the family's defaults (SigLIP without its head, ...); ours on top
    return config_class(**{**spec.init_kwargs, **_fitting(config_class, sizes), **overrides})


def tiny_config(model_type):
    entry = copy.deepcopy(FAMILIES[model_type])  # configs may edit the lists they are given
    config_class = CONFIG_MAPPING[model_type]
    # eager attention (the plain torch form); experts as transformers runs them by default (grouped)
    common = dict(attn_implementation="eager", dtype="float32")
    if not config_class.sub_configs_defaults:
        return config_class(**{**_fitting(config_class, TEXT), **entry.get("text", {}), **common})
    top = _fitting(config_class, TEXT)
    # image markers (image, video, start/end ids) at the top of the vocabulary, apart from the text tokens
    markers = sorted(f.name for f in dataclasses.fields(config_class)
                     if f.name.endswith(("_token_id", "_token_index"))
                     and f.name not in ("pad_token_id", "bos_token_id", "eos_token_id"))
    top.update({name: VOCAB - 1 - i for i, name in enumerate(markers)})
    top["text_config"] = _sub_config(config_class, "text_config", TEXT, entry.get("text", {}))
    top["vision_config"] = _sub_config(config_class, "vision_config", VISION, entry.get("vision", {}))
    return config_class(**{**top, **entry.get("top", {}), **common})


def tiny_model(model_type, seed=0):
    torch.manual_seed(seed)
    model = model_class(model_type)(tiny_config(model_type))
    revive = FAMILIES[model_type].get("revive", ())
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if not revive or not name.endswith(revive):
                continue
            if tensor.is_floating_point():
                tensor.normal_(std=0.5)
            else:  # an expert table: distinct random experts for each token
                tensor.copy_(torch.rand(tensor.shape[0], EXPERTS).argsort(-1)[:, :tensor.shape[1]])
    return model


def _marker(config, *names):
    for name in names:
        if getattr(config, name, None) is not None:
            return getattr(config, name)
    return None


def _image_inputs(model_type, config, batch, generator):
    """pixel_values and what goes with them, for one image per row."""
    vision = config.vision_config
    form = FAMILIES[model_type]["images"]
    rand = lambda *shape: torch.rand(*shape, generator=generator)  # noqa: E731
    if form == "pixels":  # (images, channels, height, width)
        size = vision.image_size if isinstance(vision.image_size, int) else vision.image_size[0]
        return {"pixel_values": rand(batch, 3, size, size)}
    if form == "frames":  # (batch, images, channels, height, width)
        return {"pixel_values": rand(batch, 1, 3, vision.image_size, vision.image_size)}
    if form == "patches":  # flattened (t, h, w) patches of every image, and each image's grid
        t, h, w = GRID
        width = 3 * vision.temporal_patch_size * vision.patch_size ** 2
        return {"pixel_values": rand(batch * t * h * w, width), "image_grid_thw": torch.tensor([GRID] * batch)}
    if form == "gemma4":  # (batch, patches, 3 * patch^2) and each patch's (x, y)
        _, h, w = GRID
        ys, xs = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        positions = torch.stack([xs.flatten(), ys.flatten()], -1)
        return {"pixel_values": rand(batch, h * w, 3 * vision.patch_size ** 2),
                "image_position_ids": positions.expand(batch, -1, -1).clone()}
    if form == "tiles":  # (batch, images, tiles, channels, height, width), one 1x1-tile image
        return {"pixel_values": rand(batch, 1, 1, 3, vision.image_size, vision.image_size),
                "aspect_ratio_ids": torch.ones(batch, 1, dtype=torch.long),
                "aspect_ratio_mask": torch.ones(batch, 1, 1, dtype=torch.long)}
    raise ValueError(form)


def tiny_inputs(model_type, model, batch=2, seq=12, seed=0, images=False):
    """input_ids, attention_mask and labels (the first three of row 0 and the right padding of
    row 1 ignored); with images, an image block in front of each row's `seq` text tokens and
    the inputs the family's vision tower takes."""
    generator = torch.Generator().manual_seed(seed)
    config = model.config
    input_ids = torch.randint(*TEXT_IDS, (batch, seq), generator=generator)
    extra = {}
    if images:
        if not is_vision_language(model_type):
            raise ValueError(f"{model_type} takes no images")
        count = FAMILIES[model_type].get("image_tokens", IMAGE_TOKENS)
        block = [config.image_token_id] * count
        start = _marker(config, "vision_start_token_id", "image_start_token_id", "boi_token_id")
        end = _marker(config, "vision_end_token_id", "image_end_token_id", "eoi_token_id")
        if start is not None:
            block = [start, *block, end]
        input_ids = torch.cat([torch.tensor([block] * batch), input_ids], 1)
        extra = _image_inputs(model_type, config, batch, generator)
        is_image = (input_ids == config.image_token_id).long()
        parameters = inspect.signature(model.forward).parameters
        if "mm_token_type_ids" in parameters:  # the M-RoPE families find the image grids by these
            extra["mm_token_type_ids"] = is_image
        if "token_type_ids" in parameters:  # Gemma 3, PaliGemma: image tokens attend both ways
            extra["token_type_ids"] = is_image
        if "cross_attention_mask" in parameters:  # Mllama: every token sees the image's one tile
            extra["cross_attention_mask"] = torch.ones(batch, input_ids.shape[1], 1, 1, dtype=torch.long)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1:, -2:] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[0, :3] = -100
    if images:
        labels = labels.masked_fill(input_ids >= TEXT_IDS[1], -100)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels, **extra}
