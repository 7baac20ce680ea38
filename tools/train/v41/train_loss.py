"""The training objective of one batch, as the training loop will use it."""
import torch
import torch.nn.functional as F


def training_loss(model, ids, indexer_weight=1.0, dspark_weight=1.0, confidence_weight=0.1):
    """ids [b, s] -> (total loss, {name: value}). Next-token cross-entropy of the backbone, plus
    the indexer losses (one per index-source layer; they train only the indexers: see
    attention.Attention._aux_target), plus DSpark's teacher-forced block loss and its confidence
    loss (on the detached taps: no gradient into the backbone)."""
    want_dspark = len(model.mtp) > 0 and dspark_weight > 0
    out = model(ids, taps=want_dspark, aux_loss=indexer_weight > 0)
    logits = out["logits"]
    lm = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    parts = {"lm": lm.detach()}
    total = lm
    for layer, l in out.get("indexer_loss", {}).items():
        parts[f"indexer{layer}"] = l.detach()
        total = total + indexer_weight * l
    if want_dspark:
        ds = model.dspark.train_forward(out["taps"], ids)
        parts["dspark"] = ds["loss"].detach()
        parts["dspark_confidence"] = ds["confidence_loss"].detach()
        total = total + dspark_weight * ds["loss"] + confidence_weight * ds["confidence_loss"]
    return total, parts
