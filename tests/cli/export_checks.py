"""What the export checks (check_export.py, check_peagle_export.py, check_dflash_export.py)
share: the checkpoint read with safetensors and json alone, the exported tensors compared with
it bit for bit, the strict load of a state dict into speculators' own model, and the GGUF
target's tensors dequantized in fp64."""
import json

import numpy as np
import torch
from safetensors import safe_open


def read_checkpoint(path):
    """A `talon train` checkpoint: (its talon.train metadata, its tensors by name)."""
    with safe_open(path, framework="pt") as f:
        return json.loads(f.metadata()["talon.train"]), {k: f.get_tensor(k) for k in f.keys()}


def check_tensors(out, ckpt, table, dtype):
    """The exported tensors `out` against the checkpoint's: exactly the table's engine names
    plus d2t and t2d; each table entry (trainer name -> (engine name, shape)) of that shape and
    dtype (fp32: the checkpoint's bits; bf16: torch's rounding of them); d2t and t2d the
    checkpoint's, d2t mapping to ascending target ids and t2d marking exactly those."""
    want = {n for n, _ in table.values()} | {"d2t", "t2d"}
    assert set(out) == want, f"tensor set: extra {set(out) - want}, missing {want - set(out)}"
    wdt = torch.float32 if dtype == "fp32" else torch.bfloat16
    iv = torch.int32 if dtype == "fp32" else torch.int16
    for tname, (ename, shape) in table.items():
        got, ref = out[ename], ckpt["w." + tname].reshape(shape).to(wdt)
        assert list(got.shape) == shape, f"{ename}: shape {list(got.shape)}, expected {shape}"
        assert got.dtype == wdt, f"{ename}: dtype {got.dtype}, expected {wdt}"
        assert torch.equal(got.view(iv), ref.view(iv)), f"{ename}: not the checkpoint's {dtype} values"
    d2t, t2d = out["d2t"], out["t2d"]
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool, (d2t.dtype, t2d.dtype)
    assert torch.equal(d2t, ckpt["d2t"]), "d2t differs from the checkpoint"
    assert torch.equal(t2d, ckpt["t2d"].to(torch.bool)), "t2d differs from the checkpoint"
    kept = (d2t + torch.arange(d2t.numel())).numpy()
    assert np.all(np.diff(kept) > 0) and kept[0] >= 0 and kept[-1] < t2d.numel(), "d2t: not ascending target ids"
    assert np.array_equal(np.nonzero(t2d.numpy())[0], kept), "t2d is not the set d2t maps to"


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
        import gguf  # only the checks that read a target need it

        self.gguf = gguf
        self.t = {x.name: x for x in gguf.GGUFReader(path).tensors}

    def __call__(self, name):
        x = self.t[name]
        return torch.from_numpy(self.gguf.quants.dequantize(x.data, x.tensor_type).copy()).to(torch.float64)

    def lm_head(self):
        """output.weight, or the token embedding when the target ties them."""
        return self("output.weight" if "output.weight" in self.t else "token_embd.weight")
