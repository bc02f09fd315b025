// A captured MLX graph replayed on new inputs: what `mx.compile`'s call does once a trace is
// cached (mlx/compile.cpp, compile_replace), without its per-call costs: the Python tree walk
// and constants key, the cache lookup, a hash map per call and the output tree.
//
// A decode step's graph is a handful of nodes (a reshape, one custom-kernel launch, a reshape),
// but MLX's compiled call of it cost 11-15 us of host time per layer and token on the H200
// machine's host (4 us on a 2-core x86 VM), against 1-2 us for one fp16 SDPA call: most of the
// gap between the compressed step and fp16 below 32k cached tokens (docs/performance.md).
//
// Tape(inputs, outputs, varying): walks the lazy graph from `outputs` back to `inputs` (matched by
// identity). Arrays with no primitive that are not inputs (constants, evaluated arrays) are kept
// as they are; every other array becomes a node holding its primitive (shared with the traced
// graph, as compile_replace shares it), its output shapes and dtypes. The graph must not be
// evaluated before the capture (evaluation detaches it). The inputs at positions `varying` are
// given at each replay; the others are kept by the tape and used as they are.
// Tape.replay(arrays): new arrays for the nodes, `arrays` in place of the varying inputs (in
// `varying`'s order); their shapes and dtypes must be the captured ones, and the default stream
// the capture's (checked, as mx.compile's cache checks them: a ValueError, then capture again).
#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <stdexcept>
#include <utility>
#include <string>
#include <unordered_map>
#include <vector>

#include "mlx/array.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/stream.h"

namespace nb = nanobind;
using mlx::core::array;

namespace {

// A value's reference: kind in the low 2 bits (0 varying input, 1 constant or kept input, 2 node
// output), index above
inline int ref(int kind, int index) { return (index << 2) | kind; }

struct Node {
  std::shared_ptr<mlx::core::Primitive> prim;
  std::vector<int> in;
  std::vector<mlx::core::Shape> shapes;
  std::vector<mlx::core::Dtype> dtypes;
};

class Tape {
 public:
  Tape(const std::vector<array>& inputs, const std::vector<array>& outputs,
       const std::vector<int>& varying)
      : stream_(mlx::core::default_stream(mlx::core::default_device())) {
    std::vector<bool> given(inputs.size(), false);
    for (int v : varying) {
      if (v < 0 || v >= (int)inputs.size() || given[v])
        throw std::invalid_argument("[Tape] varying positions must be distinct input positions");
      given[v] = true;
      const int k = (int)shapes_.size();
      // one array at two varying positions: the graph reads the first; a replay must give one
      // array there again (checked), else the tape would read the first for both
      auto it = ids_.find(inputs[v].id());
      if (it != ids_.end())
        same_.emplace_back(k, it->second >> 2);
      else
        ids_.emplace(inputs[v].id(), ref(0, k));
      shapes_.push_back(inputs[v].shape());
      dtypes_.push_back(inputs[v].dtype());
    }
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (given[i]) continue;
      auto it = ids_.find(inputs[i].id());
      if (it != ids_.end() && (it->second & 3) == 0)
        throw std::invalid_argument("[Tape] an array is both a kept and a varying input");
      if (it == ids_.end()) {
        consts_.push_back(inputs[i]);
        ids_.emplace(inputs[i].id(), ref(1, (int)consts_.size() - 1));
      }
    }
    for (const auto& o : outputs) out_.push_back(visit(o));
    ids_.clear();
  }

  std::vector<array> replay(const std::vector<array>& inputs) const {
    if (inputs.size() != shapes_.size())
      throw std::invalid_argument("[Tape.replay] expected " + std::to_string(shapes_.size()) +
                                  " arrays, got " + std::to_string(inputs.size()));
    for (size_t i = 0; i < inputs.size(); ++i)
      if (inputs[i].dtype() != dtypes_[i] || inputs[i].shape() != shapes_[i])
        throw std::invalid_argument("[Tape.replay] array " + std::to_string(i) +
                                    " differs from the captured one in shape or dtype");
    for (const auto& [k, first] : same_)
      if (inputs[k].id() != inputs[first].id())
        throw std::invalid_argument("[Tape.replay] arrays " + std::to_string(first) + " and " +
                                    std::to_string(k) + " were one array when captured");
    if (mlx::core::default_stream(mlx::core::default_device()) != stream_)
      throw std::invalid_argument("[Tape.replay] the default stream is not the capture's");
    std::vector<array> vals;
    vals.reserve(n_values_);
    std::vector<array> args;
    for (const auto& n : nodes_) {
      args.clear();
      for (int r : n.in) args.push_back(get(r, inputs, vals));
      if (n.shapes.size() == 1) {
        vals.emplace_back(n.shapes[0], n.dtypes[0], n.prim, args);
      } else {
        auto outs = array::make_arrays(n.shapes, n.dtypes, n.prim, args);
        for (auto& o : outs) vals.push_back(std::move(o));
      }
    }
    std::vector<array> out;
    out.reserve(out_.size());
    for (int r : out_) out.push_back(get(r, inputs, vals));
    return out;
  }

  size_t nodes() const { return nodes_.size(); }
  size_t constants() const { return consts_.size(); }
  // outputs that depend on no input given at replay: a graph evaluated before its capture
  // (evaluation detaches it) leaves constants, and its outputs would be what they were then
  size_t frozen_outputs() const {
    size_t n = 0;
    for (int r : out_) n += !depends(r);
    return n;
  }

 private:
  bool depends(int r) const {
    switch (r & 3) {
      case 0: return true;
      case 1: return false;
      default: return live_[r >> 2];
    }
  }

  const array& get(int r, const std::vector<array>& inputs, const std::vector<array>& vals) const {
    switch (r & 3) {
      case 0: return inputs[r >> 2];
      case 1: return consts_[r >> 2];
      default: return vals[r >> 2];
    }
  }

  // The walk from an output back to the inputs, iterative (a deep upstream graph must not run
  // out of stack): a node is recorded after all its inputs, so nodes_ is in evaluation order.
  int visit(const array& root) {
    std::vector<std::pair<array, bool>> stack;  // (array, its inputs pushed)
    stack.emplace_back(root, false);
    while (!stack.empty()) {
      const array a = stack.back().first;
      if (ids_.count(a.id())) {
        stack.pop_back();
        continue;
      }
      if (!a.has_primitive()) {
        consts_.push_back(a);
        ids_.emplace(a.id(), ref(1, (int)consts_.size() - 1));
        stack.pop_back();
        continue;
      }
      if (!stack.back().second) {
        stack.back().second = true;
        for (const auto& in : a.inputs())
          if (!ids_.count(in.id())) stack.emplace_back(in, false);
        continue;
      }
      stack.pop_back();
      Node n;
      bool live = false;
      for (const auto& in : a.inputs()) {
        n.in.push_back(ids_.at(in.id()));
        live = live || depends(n.in.back());
      }
      n.prim = a.primitive_ptr();
      auto outs = a.siblings().empty() ? std::vector<array>{a} : a.outputs();
      for (const auto& o : outs) {
        n.shapes.push_back(o.shape());
        n.dtypes.push_back(o.dtype());
      }
      const int first = n_values_;
      n_values_ += (int)outs.size();
      live_.insert(live_.end(), outs.size(), live);
      nodes_.push_back(std::move(n));
      for (size_t k = 0; k < outs.size(); ++k) ids_.emplace(outs[k].id(), ref(2, first + (int)k));
    }
    return ids_.at(root.id());
  }

  mlx::core::Stream stream_;
  std::unordered_map<std::uintptr_t, int> ids_;  // capture only
  std::vector<mlx::core::Shape> shapes_;
  std::vector<mlx::core::Dtype> dtypes_;
  std::vector<std::pair<int, int>> same_;  // (varying slot, the slot it was captured equal to)
  std::vector<array> consts_;
  std::vector<Node> nodes_;
  std::vector<int> out_;
  std::vector<bool> live_;  // per node output: depends on a varying input
  int n_values_ = 0;
};

// A decode step's tokens into the cache's window buffers (`TurboQuantCache._window_write`):
// k and v (B, H, n, D) written at slots [lo, lo + n) of axis 2 of the buffers, in place (the
// buffers' Python objects take the new arrays, as `buf[:, :, lo:hi] = k` does: the same
// slice_update), then the windows buf[:, :, :lo + n]. One call for what was four indexing
// expressions parsed in Python (~10 us of a layer's host time on a 2-core x86 VM).
std::vector<array> window_write(array& bk, array& bv, const array& k, const array& v, int lo) {
  auto write = [lo](array& buf, const array& x) {
    if (buf.ndim() != 4 || x.ndim() != 4)
      throw std::invalid_argument("[window_write] buffers and tokens are (B, H, L, D)");
    const int hi = lo + x.shape(2);
    if (lo < 0 || hi > buf.shape(2))
      throw std::invalid_argument("[window_write] slots past the buffer");
    mlx::core::Shape start = {0, 0, lo, 0};
    mlx::core::Shape stop = {buf.shape(0), buf.shape(1), hi, buf.shape(3)};
    buf.overwrite_descriptor(
        mlx::core::slice_update(buf, mlx::core::astype(x, buf.dtype()), start, stop));
    stop[2] = hi;
    return mlx::core::slice(buf, {0, 0, 0, 0}, stop);
  };
  return {write(bk, k), write(bv, v)};
}

}  // namespace

NB_MODULE(_replay, m) {
  m.doc() = "A captured MLX graph replayed on new inputs (longctx.native)";
  nb::module_::import_("mlx.core");  // mlx's array type, registered by its module
  nb::class_<Tape>(m, "Tape")
      .def(nb::init<const std::vector<array>&, const std::vector<array>&,
                    const std::vector<int>&>(),
           nb::arg("inputs"), nb::arg("outputs"), nb::arg("varying"))
      .def("replay", &Tape::replay, nb::arg("inputs"))
      .def_prop_ro("nodes", &Tape::nodes)
      .def_prop_ro("constants", &Tape::constants)
      .def_prop_ro("frozen_outputs", &Tape::frozen_outputs);
  m.def("window_write", &window_write, nb::arg("buf_k"), nb::arg("buf_v"), nb::arg("k"),
        nb::arg("v"), nb::arg("lo"));
}
