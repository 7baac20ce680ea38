// The server on the trained model (models/brown-tiny, docs/training.md): a chat request is answered
// with words of the corpus the model learned, through the chat encoding and the OpenAI endpoint.
// (A random checkpoint answers with reserved-token soup.)
#include <gtest/gtest.h>

#include <cctype>
#include <fstream>
#include <iterator>
#include <set>
#include <string>

#include "server_util.h"
#include "test_util.h"

namespace dsv41::server {
namespace {

std::string model_dir() { return test::source_dir() + "/models/brown-tiny"; }

std::vector<std::string> words_of(const std::string& text) {
  std::vector<std::string> words;
  std::string w;
  for (char c : text + " ") {
    if (std::isalpha(static_cast<unsigned char>(c))) {
      w += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    } else if (!w.empty()) {
      words.push_back(w);
      w.clear();
    }
  }
  return words;
}

TEST(ServerTrained, AnswersAChatRequestWithWordsOfTheCorpus) {
  EngineOptions eo;
  eo.model_dir = model_dir();
  eo.parallel = 2;
  LiveServer s(eo);
  const json body = {{"messages", {{{"role", "user"}, {"content", "Tell me about the jury and the election."}}}},
                     {"max_tokens", 48},
                     {"temperature", 0},
                     {"thinking", false}};  // chat mode: the answer is the content, not reasoning
  const Reply r = post(s.port(), "/v1/chat/completions", body);
  ASSERT_EQ(r.status, 200) << r.raw << r.error;
  const std::string content = r.body["choices"][0]["message"]["content"].get<std::string>();
  std::printf("[trained] chat answer: %s\n", content.c_str());
  std::ifstream in(model_dir() + "/heldout.txt");
  const std::string heldout((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::vector<std::string> corpus = words_of(heldout), answer = words_of(content);
  const std::set<std::string> known(corpus.begin(), corpus.end()), distinct(answer.begin(), answer.end());
  int in_corpus = 0;
  for (const std::string& w : answer) in_corpus += known.count(w) > 0;
  EXPECT_GE(distinct.size(), 4u) << content;
  EXPECT_GE(in_corpus, static_cast<int>(0.8 * static_cast<double>(answer.size()))) << content;
  EXPECT_EQ(content.find("<\xEF\xBD\x9C"), std::string::npos) << "no special tokens in the text: " << content;
}

}  // namespace
}  // namespace dsv41::server
