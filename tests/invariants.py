"""The promises every path must keep, each written once as a check (DESIGN.md decision 10). A test builds the
path (a client, an engine, a lifecycle step) and calls the check on what the path produced."""

from __future__ import annotations

import torch


@torch.no_grad()
def assert_masters_equal(opt, model: torch.nn.Module, exported: dict[str, torch.Tensor], *,
                         absent_ok: tuple[str, ...] = ()) -> None:
    """The masters a checkpoint or export yields equal the live optimizer's, bit for bit.

    ``exported``: name -> tensor, as read back from the export (or from ``master_weights``). Each parameter of
    ``model`` that ``opt`` holds is compared, under every name ``model.state_dict()`` gives it (tied weights),
    with ``opt.master_weight(p)`` (param + rho) as fp32; every other entry of the model's state dict with the
    model's value as fp32 (integers as they are). The names must be the model's, less ``absent_ok`` (e.g. a tied
    LM head that ``save_pretrained`` leaves out). The check can fail on a 16-bit export: some master must differ
    from its 16-bit parameter (rho must carry something), else the model was not trained enough to tell."""
    held = {id(p) for group in opt.param_groups for p in group["params"]}
    expected = {}
    for name, value in model.state_dict(keep_vars=True).items():
        if id(value) in held:
            value = opt.master_weight(value)
        expected[name] = value.detach().float() if value.is_floating_point() else value.detach()
    assert set(exported) == set(expected) - set(absent_ok), (
        f"names: missing {sorted(set(expected) - set(absent_ok) - set(exported))[:5]}, "
        f"unexpected {sorted(set(exported) - set(expected))[:5]}")
    wrong = [n for n in exported if not (exported[n].dtype == expected[n].dtype
                                         and torch.equal(exported[n].cpu(), expected[n].cpu()))]
    assert not wrong, f"{len(wrong)} of {len(exported)} exported tensors are not the live masters: {wrong[:5]}"
    carried = [n for n, p in model.named_parameters() if id(p) in held and p.dtype in (torch.bfloat16, torch.float16)
               and n in exported and not torch.equal(exported[n], p.detach().float())]
    sixteen = [p for p in model.parameters() if id(p) in held and p.dtype in (torch.bfloat16, torch.float16)]
    assert carried or not sixteen, "no master differs from its 16-bit parameter: rho carries nothing to check"
