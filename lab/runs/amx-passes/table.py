"""Markdown tables from rows.py's JSON files: the best of the runs per code version, and the
ratio before / after.

    python lab/runs/amx-passes/table.py before-*.json -- after-*.json
"""

import json
import sys


def best(paths: list[str]) -> dict:
    merged: dict = {"linear": {}, "target": {}}
    for path in paths:
        with open(path) as file:
            data = json.load(file)
        for shape, rows in data["linear"].items():
            into = merged["linear"].setdefault(shape, {})
            for m, ms in rows.items():
                into[m] = min(into.get(m, 1e9), ms)
        for key, ms in data["target"].items():
            merged["target"][key] = min(merged["target"].get(key, 1e9), ms)
    return merged


def main() -> None:
    split = sys.argv.index("--")
    before, after = best(sys.argv[1:split]), best(sys.argv[split + 1 :])
    for shape, rows in before["linear"].items():
        print(f"\nlinear [{shape.replace('x', ', ')}]\n")
        print("| rows | before ms | after ms | before / after |")
        print("|---:|---:|---:|---:|")
        for m, ms in rows.items():
            new = after["linear"][shape][m]
            print(f"| {m} | {ms:.3f} | {new:.3f} | {ms / new:.2f}x |")
    print("\nwhole target, one forward after a 128-token prompt\n")
    print("| new tokens | before ms | v(n) | after ms | v(n) | before / after |")
    print("|---|---:|---:|---:|---:|---:|")
    b1, a1 = before["target"]["1"], after["target"]["1"]
    for key, ms in before["target"].items():
        new = after["target"][key]
        v = "" if key.startswith("prefill") else f"{ms / b1:.2f}"
        w = "" if key.startswith("prefill") else f"{new / a1:.2f}"
        print(f"| {key} | {ms:.1f} | {v} | {new:.1f} | {w} | {ms / new:.2f}x |")


if __name__ == "__main__":
    main()
