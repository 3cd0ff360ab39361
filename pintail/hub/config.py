"""transformers' KernelConfig for pintail's local repository (this module imports transformers)."""

from pathlib import Path

from transformers import KernelConfig

from .modes import every_mode


class PintailKernelConfig(KernelConfig):
    """KernelConfig(use_local_kernel=True) whose layers hold in every mode, on CUDA and CPU.
    transformers 5.25's own expansion of a local mapping fails inside from_pretrained (it splits
    the (path, metadata) pair from_pretrained made of the string), refuses the CPU, and keys the
    layer to the mode of the model when loaded (inference), which model.train() would drop."""

    def sanitize_kernel_mapping(self, model):
        # transformers raises for a layer name the model does not mark; many families mark one of
        # pintail's two (Phi-3 its norm, Gemma its rotary), so keep those the model marks
        self.store_registered_layer_names(model)
        marked = set(self.registered_layer_names.values())
        wanted, self.kernel_mapping = self.kernel_mapping, {n: r for n, r in self.kernel_mapping.items() if n in marked}
        if not self.kernel_mapping:
            raise ValueError(f"pintail.hub: {type(model).__name__} marks none of {sorted(wanted)} with "
                             "use_kernel_forward_from_hub; pintail.patch(model) knows more families")
        super().sanitize_kernel_mapping(model)

    def create_compatible_mapping(self, model, compile=False):
        from kernels import LocalLayerRepository

        mapping = {}
        for name, repo in self.kernel_mapping.items():
            # "path:Layer", or (that string, {"version": ...}) once from_pretrained has read it
            path, _, layer = (repo[0] if isinstance(repo, tuple) else repo).rpartition(":")
            mapping[name] = every_mode(LocalLayerRepository(Path(path), layer_name=layer))
        self.kernel_mapping = mapping
