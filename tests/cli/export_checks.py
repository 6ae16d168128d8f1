"""What the speculators export checks (check_peagle_export.py, check_dflash_export.py) share:
the strict load of a state dict into speculators' own model, and the GGUF target's tensors
dequantized in fp64."""
import gguf
import torch


def strict_load(model, sd):
    """Loads sd (cast to fp64) into model: no unexpected key, and missing only the keys the
    model itself never saves (_keys_to_ignore_on_save)."""
    res = model.load_state_dict({k: v.to(torch.float64) if v.is_floating_point() else v for k, v in sd.items()},
                                strict=False)
    assert not res.unexpected_keys, f"unexpected keys {res.unexpected_keys}"
    allowed = set(model._keys_to_ignore_on_save)
    assert set(res.missing_keys) == allowed, f"missing {res.missing_keys}, the model itself omits {allowed}"


class GgufTarget:
    """The target's tensors from its GGUF file, dequantized to fp64 torch tensors."""

    def __init__(self, path):
        self.t = {x.name: x for x in gguf.GGUFReader(path).tensors}

    def __call__(self, name):
        x = self.t[name]
        return torch.from_numpy(gguf.quants.dequantize(x.data, x.tensor_type).copy()).to(torch.float64)

    def lm_head(self):
        """output.weight, or the token embedding when the target ties them."""
        return self("output.weight" if "output.weight" in self.t else "token_embd.weight")
