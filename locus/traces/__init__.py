"""Expert-activation traces: format, reader/writer, synthesis, import, statistics. numpy only."""
