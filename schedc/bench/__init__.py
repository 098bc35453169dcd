"""The benchmarks behind `schedc bench` (installed, so the command works after a pip install).

- `scenarios`: the seeded matrix of clusters, models and failures, as spec text;
- `compare`: every planner and baseline on every scenario, verified and simulated,
  into tables, CSVs and charts (`run_benchmark`);
- `chart`: the SVG line chart every benchmark figure is drawn with, also by the
  hand-run scripts in bench/.
"""
