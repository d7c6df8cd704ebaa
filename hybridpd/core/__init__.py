"""The pipeline every command reads: model -> release -> layout -> transfer plan -> findings (pure)."""
