// How an optimizer's state is laid out, so that OSS can shard it: a public registration for
// optimizer classes shardopt does not know (it knows torch::optim's Adam, AdamW, SGD, RMSprop and
// Adagrad, and shardopt::Muon, which is registered through this same call).
//
// An element-wise optimizer updates each element from that element's gradient and state only
// (Adam, SGD): its parameters may be cut into ranges with different owners, like Adam's. A
// whole-tensor optimizer needs the whole parameter at once (Muon orthogonalises a matrix, Shampoo
// preconditions one): each parameter stays whole on one owner, and the owners are chosen to
// balance the update's cost (`cost`, Note [Ownership by kind] in csrc/optim/placement.cpp).
//
//   shardopt::register_optimizer(
//       shardopt::OptimizerRegistration<MyOpt, MyOptions, MyParamState>("MyOpt", shardopt::StateKind::kElementWise)
//           .option("lr", [](MyOptions& o) -> double& { return o.lr(); })
//           .option("beta", [](MyOptions& o) -> double& { return o.beta(); })
//           .step([](MyParamState& s) -> int64_t& { return s.step(); })
//           .tensor("velocity", [](MyParamState& s) -> at::Tensor& { return s.velocity(); }));
//
// With it, OSS rebalances the optimizer's state after a freeze, consolidates it, writes it in
// PyTorch's state_dict layout ({"state": {index: {name: value}}, "param_groups": [...]}, with the
// registered names), and loads it on any world size. Without one, OSS refuses the class unless
// OSSOptions().rebalance(false) is passed, naming it. Registering again replaces the earlier
// registration; registering one of the classes shardopt knows is an error. Registration is
// process-wide; do it before constructing an OSS.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/util/ArrayRef.h>
#include <torch/csrc/api/include/torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <typeindex>
#include <utility>
#include <vector>

namespace shardopt {

namespace detail {
// `v` as a T, where a saved number may be an int or a double; errors name the option.
template <class T>
T option_value(const std::string& name, const c10::IValue& v) {
  if constexpr (std::is_same_v<T, double>) {
    TORCH_CHECK(v.isDouble() || v.isInt(), "state_dict option '", name, "' must be a number, got ", v.tagKind());
    return v.isDouble() ? v.toDouble() : static_cast<double>(v.toInt());
  } else if constexpr (std::is_same_v<T, bool>) {
    TORCH_CHECK(v.isBool(), "state_dict option '", name, "' must be a bool, got ", v.tagKind());
    return v.toBool();
  } else if constexpr (std::is_same_v<T, int64_t>) {
    TORCH_CHECK(v.isInt(), "state_dict option '", name, "' must be an integer, got ", v.tagKind());
    return v.toInt();
  } else {
    return v.to<T>();
  }
}
}  // namespace detail

// How a state tensor may be kept under OSSOptions::state_format(StateFormat::kInt8): in 8-bit
// codes from the signed dynamic map (values of either sign: first moments, momentum) or the
// unsigned one (values >= 0: second moments); kNone, the default, keeps it fp32.
enum class StateCodes { kNone, kSigned, kUnsigned };

enum class StateKind {
  kElementWise,  // split into ranges like Adam's state
  kWholeTensor,  // kept whole, each parameter on one owner
};

// What shardopt keeps of a registration, without the classes' types.
struct OptimizerLayout {
  struct Option {
    std::string name;
    std::function<c10::IValue(const torch::optim::OptimizerOptions&)> get;
    std::function<void(torch::optim::OptimizerOptions&, const c10::IValue&)> set;
  };
  struct Entry {
    std::string name;
    std::function<at::Tensor&(torch::optim::OptimizerParamState&)> field;
    // The entry's shape for a parameter of shape `param`; null: the parameter's shape.
    std::function<std::vector<int64_t>(at::IntArrayRef param)> shape;
    StateCodes codes = StateCodes::kNone;  // whether 8-bit state may code it (compressible())
  };
  std::string name;  // the class's name in a saved state (PyTorch's, where it has one)
  StateKind kind = StateKind::kElementWise;
  std::vector<Option> options;
  std::vector<std::pair<std::string, c10::IValue>> constants;
  std::vector<Entry> tensors;
  std::function<int64_t&(torch::optim::OptimizerParamState&)> step;
  std::function<std::unique_ptr<torch::optim::OptimizerParamState>()> make_state;
  std::function<double(at::IntArrayRef param)> cost;
};

// The registration of optimizer class `Opt`, with options `Options` and per-parameter state
// `ParamState` (each derived from torch::optim's Cloneable bases, as LibTorch's own optimizers).
template <class Opt, class Options, class ParamState>
class OptimizerRegistration {
 public:
  // `name`: the class's name in a saved state; `kind`: how its state may be cut.
  OptimizerRegistration(std::string name, StateKind kind) {
    layout_.name = std::move(name);
    layout_.kind = kind;
    layout_.make_state = [] { return std::make_unique<ParamState>(); };
  }

  // An option of each parameter group, saved as `name` (a number, bool, string or list of
  // numbers, whatever `field` refers to).
  template <class T>
  OptimizerRegistration& option(std::string name, std::function<T&(Options&)> field) {
    layout_.options.push_back(
        {name,
         [field](const torch::optim::OptimizerOptions& o) {
           return c10::IValue(field(const_cast<Options&>(static_cast<const Options&>(o))));
         },
         [field, name](torch::optim::OptimizerOptions& o, const c10::IValue& v) {
           field(static_cast<Options&>(o)) = detail::option_value<T>(name, v);
         }});
    return *this;
  }
  OptimizerRegistration& option(std::string name, std::function<double&(Options&)> field) {
    return option<double>(std::move(name), std::move(field));
  }
  OptimizerRegistration& option(std::string name, std::function<bool&(Options&)> field) {
    return option<bool>(std::move(name), std::move(field));
  }
  OptimizerRegistration& option(std::string name, std::function<int64_t&(Options&)> field) {
    return option<int64_t>(std::move(name), std::move(field));
  }
  // An option saved in a form of its own: `get` writes it, `set` reads it back.
  OptimizerRegistration& option(std::string name, std::function<c10::IValue(const Options&)> get,
                                std::function<void(Options&, const c10::IValue&)> set) {
    layout_.options.push_back(
        {std::move(name), [get](const torch::optim::OptimizerOptions& o) { return get(static_cast<const Options&>(o)); },
         [set](torch::optim::OptimizerOptions& o, const c10::IValue& v) { set(static_cast<Options&>(o), v); }});
    return *this;
  }
  // A key every saved group carries with a fixed value (one the Python class has and this one
  // does not, so that Python's load_state_dict sees a complete group).
  OptimizerRegistration& constant(std::string name, c10::IValue value) {
    layout_.constants.emplace_back(std::move(name), std::move(value));
    return *this;
  }
  // A state tensor of each parameter, saved as `name`. Shaped like its parameter, unless `shape`
  // says otherwise (whole-tensor optimizers only: an element-wise one's state is cut like its
  // parameter). An undefined tensor is not saved.
  OptimizerRegistration& tensor(std::string name, std::function<at::Tensor&(ParamState&)> field,
                                std::function<std::vector<int64_t>(at::IntArrayRef)> shape = nullptr) {
    layout_.tensors.push_back(
        {std::move(name),
         [field](torch::optim::OptimizerParamState& s) -> at::Tensor& { return field(static_cast<ParamState&>(s)); },
         std::move(shape)});
    return *this;
  }
  // Marks state tensor `name` (registered with tensor(), shaped like its parameter) as one that
  // OSSOptions::state_format(StateFormat::kInt8) keeps in 8-bit codes with the map `codes` names.
  // Under kInt8 an optimizer that marks none is refused, naming it; its own step then runs on the
  // tensors decoded to fp32, which are coded again after it.
  OptimizerRegistration& compressible(const std::string& name, StateCodes codes = StateCodes::kSigned) {
    for (auto& entry : layout_.tensors) {
      if (entry.name == name) {
        TORCH_CHECK(!entry.shape, "register_optimizer: state entry '", name, "' has a shape of its own; only "
                    "tensors shaped like their parameter may be compressible");
        entry.codes = codes;
        return *this;
      }
    }
    TORCH_CHECK(false, "register_optimizer: compressible('", name, "') names no state tensor registered before it");
    return *this;
  }
  // The step counter, saved as "step" (a float tensor, as PyTorch saves it).
  OptimizerRegistration& step(std::function<int64_t&(ParamState&)> field) {
    layout_.step = [field](torch::optim::OptimizerParamState& s) -> int64_t& {
      return field(static_cast<ParamState&>(s));
    };
    return *this;
  }
  // The cost of one parameter's update, from its shape: what whole-tensor owners balance.
  // Default: its number of elements.
  OptimizerRegistration& cost(std::function<double(at::IntArrayRef)> fn) {
    layout_.cost = std::move(fn);
    return *this;
  }

  const OptimizerLayout& layout() const { return layout_; }

 private:
  OptimizerLayout layout_;
};

namespace detail {
void register_layout(std::type_index type, const std::string& type_name, OptimizerLayout layout);
}

// Registers `registration` for its optimizer class (see above). Errors name the problem: a class
// shardopt knows already, an element-wise optimizer with an entry of another shape, no name.
template <class Opt, class Options, class ParamState>
void register_optimizer(const OptimizerRegistration<Opt, Options, ParamState>& registration) {
  static_assert(std::is_base_of_v<torch::optim::Optimizer, Opt>, "Opt must derive from torch::optim::Optimizer");
  static_assert(std::is_base_of_v<torch::optim::OptimizerOptions, Options>,
                "Options must derive from torch::optim::OptimizerOptions");
  static_assert(std::is_base_of_v<torch::optim::OptimizerParamState, ParamState>,
                "ParamState must derive from torch::optim::OptimizerParamState");
  detail::register_layout(std::type_index(typeid(Opt)), typeid(Opt).name(), registration.layout());
}

// Whether OSS knows how `Opt`'s state is laid out (built in or registered).
bool knows_optimizer(const torch::optim::Optimizer& optimizer);

}  // namespace shardopt
