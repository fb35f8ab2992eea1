"""The decode service's own settings (environment prefix KVMESH_DECODE_, file table [decode])."""

from __future__ import annotations

from dataclasses import replace
from typing import ClassVar, Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from shared.engine.interface import EngineOptions
from shared.worker import WorkerSettings


class DecodeSettings(WorkerSettings):
    model_config = SettingsConfigDict(env_prefix="KVMESH_DECODE_")
    file_table: ClassVar[str] = "decode"

    kv_port: int = Field(
        default=0, ge=0, le=65535, description="gRPC port that receives KV handoffs; 0: any"
    )
    max_queued: int = Field(
        default=64, ge=0, description="local-prefill tasks waiting at most; more are refused"
    )
    engine_process: bool = Field(
        default=True,
        description="run the engine's step loop in a process of its own beside the worker "
        "(its steps share no GIL with the worker's event loop); false: on a thread of the worker",
    )
    batch_share: float = Field(
        default=0.75,
        gt=0,
        le=1,
        description="flex and batch work is admitted while the sequences held and the KV used "
        "are under this share of the whole; the rest stays free for higher classes",
    )
    speculative: Literal["off", "fixed", "adaptive"] = Field(
        default="adaptive",
        description="speculative decoding by n-gram drafts: off; fixed (every sequence verifies "
        "up to fixed_draft drafted tokens a step); adaptive (each sequence as many as pay, by "
        "its own acceptance and the engine's measured cost)",
    )
    max_draft: int = Field(
        default=8, ge=1, le=32, description="drafted tokens per sequence, at most"
    )
    fixed_draft: int = Field(default=5, ge=1, le=32, description="the fixed mode's draft length")
    max_ngram: int = Field(default=4, ge=1, le=16, description="longest n-gram a draft matches")
    eplb_cards: int = Field(
        default=0,
        ge=0,
        le=4096,
        description="MoE expert placement over this many cards (logical groups of expert slots "
        "in one process); 0: off",
    )
    eplb_slots: int = Field(
        default=0,
        ge=0,
        description="expert slots in all, a multiple of eplb_cards; the slots past the experts "
        "hold replicas of busy ones; 0: one per expert",
    )
    eplb_window_steps: int = Field(
        default=1000, ge=1, description="decode steps per window of expert load statistics"
    )
    eplb_replan_steps: int = Field(
        default=10_000,
        ge=1,
        description="decode steps between placement plans, a multiple of eplb_window_steps",
    )
    eplb_move_cost: float = Field(
        default=0.05,
        ge=0,
        description="what moving one expert costs, in mean-card decode steps: a plan is taken "
        "only when its predicted gain over the interval beats its moves' cost",
    )
    eplb_record: str = Field(
        default="",
        description="write each decode step's expert counts to this load file (.npz or .json), "
        "for kvmesh eplb plan",
    )

    def engine_options(self) -> EngineOptions:
        return replace(
            super().engine_options(),
            speculative=self.speculative,
            max_draft=self.max_draft,
            fixed_draft=self.fixed_draft,
            max_ngram=self.max_ngram,
            eplb_cards=self.eplb_cards,
            eplb_slots=self.eplb_slots,
            eplb_window_steps=self.eplb_window_steps,
            eplb_replan_steps=self.eplb_replan_steps,
            eplb_move_cost=self.eplb_move_cost,
            eplb_record=self.eplb_record,
        )
