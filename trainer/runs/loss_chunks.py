"""The loss execution options of a run: the chunk rows of the fused route follow from the vocabulary alone, so
admission, a resume and the device plan (trainer.runs.device_plan) compute the same ones."""


# the fused route's logits chunk in a run: about this many bytes of [rows, vocabulary] logits at a time (at
# least the engine's 64 rows). Larger chunks make the two products per chunk efficient (measured at the
# SmolLM2 shape: 256 rows take 0.6x the time of 64) while the route still never forms the whole logits
LOSS_CHUNK_BYTES = 64 << 20


def loss_options(route: str, vocabulary_size: int) -> dict:
    """load_base's loss execution options for a run on ROUTE over a base of VOCABULARY_SIZE: the chunk rows
    of kt_tape_flce follow from the vocabulary alone, so a resume computes the same ones."""
    if route != "kt_tape_flce":
        return {"loss_route": route}
    return {"loss_route": route, "loss_chunk_tokens": max(64, LOSS_CHUNK_BYTES // (4 * int(vocabulary_size)))}
