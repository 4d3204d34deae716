/// \file
/// The whole public API of mha.
#pragma once

#include "mha/attention.hpp"
#include "mha/decode.hpp"
#include "mha/error.hpp"
#include "mha/io.hpp"
#include "mha/multi_head_attention.hpp"
#include "mha/paged_kv_cache.hpp"
#include "mha/rotary.hpp"
#include "mha/score.hpp"
#include "mha/tensor.hpp"
#include "mha/varlen.hpp"
