"""Code generation: per-rank PyTorch programs from a verified schedule.

`write_programs(spec, schedule, out_dir, metrics=...)` is the entry point used
by `Plan.write` and `schedc compile -o OUT`.
"""

from schedc.codegen.generate import program_name, render_programs, write_programs

__all__ = ["program_name", "render_programs", "write_programs"]
