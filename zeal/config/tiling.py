"""The ``tiling`` section: Arctic Long Sequence Training's TiledMLP and tiled logits loss."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

Shards = Annotated[int, Field(ge=1)] | Literal["auto"]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TiledMLPConfig(_Section):
    """TiledMLP (:class:`zeal.models.tiled.TiledMLP`) on every dense decoder MLP."""

    enabled: bool = Field(False, description="Run each dense MLP over sequence tiles, recomputed tile by tile in "
                                             "backward (intermediate activations of one tile).")
    num_shards: Shards = Field(
        "auto", description="Tiles per MLP call; 'auto' = ceil(tokens / hidden_size) (ALST's choice).")


class TiledLossConfig(_Section):
    """The tiled logits loss (:func:`zeal.models.tiled.tiled_logits_loss`) of zeal's GPT and Llama."""

    enabled: bool = Field(False, description="Score the LM head's logits over row tiles: [tokens, vocab] logits are "
                                             "never whole, in forward or backward.")
    num_shards: Shards = Field(
        "auto", description="Tiles of the loss; 'auto' = tiles of at most 2**23 logits (32 MiB in fp32).")


class TilingConfig(_Section):
    """ALST tiling; each part on by its own ``enabled``, composable with activation
    checkpointing (and its ``cpu_checkpointing``), ZeRO 0-3 and tensor parallelism."""

    tiled_mlp: TiledMLPConfig = Field(default_factory=TiledMLPConfig, description="TiledMLP.")
    tiled_logits_loss: TiledLossConfig = Field(default_factory=TiledLossConfig,
                                               description="The tiled logits loss.")
