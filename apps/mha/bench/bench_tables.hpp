// The tables `mha bench` prints on stdout, a row as soon as it is measured.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "bench/bench_results.hpp"

namespace mha_cli::bench {

std::string format_bytes(std::int64_t bytes);  // "45 MiB", "1.94 GiB"

void print_machine(const BenchResults& results);
void print_roof_note();

void print_core_header(std::int64_t heads, std::int64_t d);
void print_core_row(const CoreResult& row);

void print_scaling(const ScalingResult& scaling);
void print_layout_header();
void print_layout_row(const LayoutResult& row);
void print_causal(const std::vector<CausalResult>& rows);

void print_layer_header(const std::string& torch_label);
void print_layer_row(const LayerResult& row);

void print_blas_peer(const BlasPeer& peer);  // its header, or its status when it was not measured

void print_grid_header(const std::string& torch_label, const RepeatPolicy& policy);
void print_grid_row(const GridRow& row);
void print_grid_threads(const std::vector<GridRow>& rows);  // ours: the largest thread count against the smallest

void print_big_header();
void print_big_row(const BigResult& row);

// The targets this run judged (met or missed); those it could not measure are counted in one line.
// A non-empty `smoke_run` labels the heading (e.g. a --quick run's verdicts are not the targets').
void print_targets(const std::vector<TargetResult>& targets, const std::string& smoke_run);

}  // namespace mha_cli::bench
