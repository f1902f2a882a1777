#include "classifier.h"

#include "cnn.h"
#include "vit.h"

#include <shardopt/check.h>

namespace shardopt::app {

std::shared_ptr<Classifier> make_classifier(const std::string& name) {
  if (name == "cnn") return std::make_shared<Cnn>();
  if (name == "vit") return std::make_shared<Vit>();
  SHARDOPT_CHECK(false, "--model '", name, "' is not one of cnn, vit");
}

}  // namespace shardopt::app
