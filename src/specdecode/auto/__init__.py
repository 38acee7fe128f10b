"""The automatic choices: this machine's measured costs and acceptance for a target/draft pair
(calibration), and the k or tree shape they make fastest, as `--k auto` / `--tree auto` read them
(docs/architecture.md, "The floors")."""
