"""The end-of-job report: printed, and saved as ``.batchgen/report.json`` in the output directory."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields


@dataclass
class JobReport:
    rows_total: int | None = None
    rows_previously_done: int = 0
    rows_ok: int = 0
    rows_failed: int = 0
    duplicate_ids: int = 0  # rows whose id an earlier row has: error rows, known by their position
    structured_cut_short: int = 0  # rows with structured outputs where a completion hit max_tokens inside it
    errors: dict[str, int] = field(default_factory=dict)  # failed rows of this run by message
    rows_in_output: int = 0
    failed_in_output: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    rows_deduplicated: int = 0  # rows whose identical request (prompt and parameters) was computed once
    prompt_tokens_perfect_order: int | None = None  # each distinct prompt block once (None: not counted)
    wall_s: float = 0.0
    engine: dict = field(default_factory=dict)
    nothing_to_do: int = 0  # set (to the rows already done) when a rerun found every row done

    @classmethod
    def from_dict(cls, d: dict) -> JobReport:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s else 0.0

    def fill_engine_stats(self, stats: dict) -> None:
        self.engine = stats

    def to_dict(self) -> dict:
        d = asdict(self)
        e = self.engine
        logical, physical = e.get("peak_logical_kv_tokens", 0), e.get("peak_physical_kv_slots", 0)
        d.update(
            generated_tokens_per_s=round(self.tokens_per_s, 2),
            prefix_cache_hit_rate=round(e.get("prefix_cache_hit_tokens", 0) / self.prompt_tokens, 4)
            if self.prompt_tokens
            else 0.0,
            kv_saved_by_sharing=round(e.get("kv_saved_by_sharing", 0.0), 4),
            peak_physical_over_logical=round(physical / logical, 4) if logical else 0.0,
            peak_kv_blocks_used=e.get("peak_blocks_used", 0),
            kv_blocks=e.get("num_blocks", 0),
            prompt_tokens_computed=e.get("prompt_tokens_computed", 0),
        )
        return d

    def render(self) -> str:
        d = self.to_dict()
        lines = [
            "batchgen job report"
            + (
                f"\n  nothing to do: all rows are in the output (resumed: {self.nothing_to_do} rows were "
                "already done); the report of the run that finished them follows"
                if self.nothing_to_do
                else ""
            ),
            f"  rows ok / failed (this run)  {self.rows_ok} / {self.rows_failed}"
            + (
                f"   (resumed: {self.rows_previously_done} rows were already done)"
                if self.rows_previously_done
                else ""
            ),
            f"  rows in output (failed)      {self.rows_in_output} ({self.failed_in_output})",
            f"  tokens in / out              {self.prompt_tokens} / {self.generated_tokens}",
            f"  wall time                    {self.wall_s:.1f} s   ({d['generated_tokens_per_s']:.1f} generated tokens/s)",
            f"  prefix-cache hit rate        {d['prefix_cache_hit_rate']:.1%}",
            f"  threads                      {self.engine.get('num_threads', '?')}   "
            f"({self.engine.get('num_threads_reason', 'not recorded')}; {self.engine.get('omp_wait_policy', '')})",
            f"  prompt tokens computed       {d['prompt_tokens_computed']}"
            + (
                f"   (each distinct prompt block once: {self.prompt_tokens_perfect_order})"
                if self.prompt_tokens_perfect_order is not None
                else ""
            ),
            f"  KV memory saved by sharing   {d['kv_saved_by_sharing']:.1%}   "
            f"(peak {d['peak_kv_blocks_used']} of {d['kv_blocks']} blocks)",
            f"  copy-on-write block copies   {self.engine.get('cow_copies', 0)}   "
            f"(KV tokens held at peak: {self.engine.get('peak_logical_kv_tokens', 0)} logical in "
            f"{self.engine.get('peak_physical_kv_slots', 0)} slots)",
        ]
        top = sorted(self.errors.items(), key=lambda kv: -kv[1])
        for message, count in top[:5]:
            lines.append(f"  failed x {count:<6}           {message[:100]}")
        if len(top) > 5:
            lines.append(f"  failed, {len(top) - 5} other messages  {sum(c for _, c in top[5:])} rows")
        if self.rows_deduplicated:
            lines.append(f"  identical rows computed once {self.rows_deduplicated} copies")
        if self.structured_cut_short:
            lines.append(
                f"  structured rows cut short   {self.structured_cut_short}   (a completion reached max_tokens "
                "inside its grammar: finish_reason length)"
            )
        if self.duplicate_ids:
            lines.append(f"  rows with a repeated id      {self.duplicate_ids}   (error rows)")
        return "\n".join(lines)
