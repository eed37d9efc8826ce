"""What a run says and leaves to read: its console lines (`console`), its summary file (`summary_file`, metrics.json),
its CSV log across resumes (`csv_log`), model FLOPs (`flops`), where runs are (`runs`), a sweep's report
(`sweep_report`) and per-step loss comparison across strategies (`equivalence`)."""
