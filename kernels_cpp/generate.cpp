// generate.cpp — the round loop: plain decoding, speculative decoding with a draft model,
// and prompt-lookup drafting, all in C++ so no Python lands in a timing.
//
// Invariant at the start of every round: the target's KV cache holds every token but the
// last (`pending`); the draft's holds a prefix of them.
#include <algorithm>
#include <cmath>
#include <vector>

#include "clock.h"
#include "lab.h"
#include "threadpool.h"

namespace lab {

namespace {

float top_probability(const float* logits, int n) {
    const float mx = logits[argmax(logits, n)];
    double z = 0;
    for (int i = 0; i < n; i++) z += std::exp((double)logits[i] - mx);
    return (float)(1.0 / z);
}

// Prompt lookup: the tokens that followed the latest earlier occurrence of the context's
// last n tokens (longest n first), up to gamma of them.
int lookup(const std::vector<int32_t>& ctx, int ngram_max, int gamma, int32_t* out) {
    const int len = (int)ctx.size();
    for (int n = std::min(ngram_max, len - 1); n >= 1; n--) {
        const int32_t* suffix = ctx.data() + len - n;
        for (int s = len - n - 1; s >= 0; s--) {
            if (!std::equal(suffix, suffix + n, ctx.data() + s)) continue;
            const int g = std::min(gamma, len - (s + n));
            std::copy(ctx.data() + s + n, ctx.data() + s + n + g, out);
            return g;
        }
    }
    return 0;
}

struct Timer {
    double& acc;
    double t0 = now();
    explicit Timer(double& a) : acc(a) {}
    ~Timer() { acc += now() - t0; }
};

}  // namespace

Generator::Generator(Model* target, Model* draft, ThreadPool* pool, int path)
    : target_(target), draft_(draft), pool_(pool), path_(path) {}

int Generator::produced() const { return produced_; }

// Appends a token; returns 1 when generation must stop (end of sequence or the budget).
int Generator::emit(int32_t tok, int32_t* out, const GenParams& gp) {
    out[produced_] = tok;
    produced_ = produced_ + 1;
    stats_.new_tokens++;
    for (int i = 0; i < gp.n_eos; i++)
        if (tok == gp.eos[i]) { stats_.stopped_on_eos = 1; return 1; }
    return produced_ >= gp.max_new_tokens;
}

int Generator::run(const int32_t* prompt, int n_prompt, const GenParams& gp, int32_t* out,
                   int32_t* drafted, int32_t* accepted, int max_rounds) {
    stats_ = GenStats{};
    produced_ = 0;
    const bool spec = gp.mode != GEN_PLAIN;
    if (n_prompt < 1) return E_EMPTY;
    if (spec && (gp.gamma < 1 || gp.gamma > MAX_K)) return E_GAMMA;
    if (gp.mode == GEN_DRAFT && (!draft_ || draft_->vocab() != target_->vocab())) return E_VOCAB;
    const int need = n_prompt + gp.max_new_tokens + (spec ? gp.gamma : 0);
    if (need > target_->max_context() || (gp.mode == GEN_DRAFT && need > draft_->max_context())) return E_CONTEXT;
    if (gp.max_new_tokens < 1) return E_OK;
    const int V = target_->vocab();
    const bool greedy = gp.sample.temperature <= 0.f;
    const double t_start = now();
    PinScope pin(pool_);
    Rng rng(gp.seed);
    std::vector<int32_t> ctx(prompt, prompt + n_prompt);
    std::vector<float> tl((size_t)(MAX_K + 1) * V), dl(V), p(V), q(greedy ? 0 : (size_t)MAX_K * V);
    int tpos = n_prompt - 1, dpos = 0, rc = E_OK;

    stats_.prompt_tokens = n_prompt;
    if (tpos > 0) {                              // the prompt pass: target, and draft alike
        Timer t(stats_.t_prompt);
        if ((rc = target_->forward(prompt, tpos, 0, nullptr, LOGITS_NONE, nullptr, pool_, path_))) return rc;
        if (gp.mode == GEN_DRAFT) {
            if ((rc = draft_->forward(prompt, tpos, 0, nullptr, LOGITS_NONE, nullptr, pool_, path_))) return rc;
            dpos = tpos;
        }
    }
    int32_t guess[MAX_K];
    bool stop = false;
    while (!stop) {
        // -- draft ------------------------------------------------------------------------
        int g = 0;
        if (gp.mode == GEN_DRAFT) {
            Timer t(stats_.t_draft);
            const int n = (int)ctx.size() - dpos;      // catch up, the pending token included
            if ((rc = draft_->forward(ctx.data() + dpos, n, dpos, dl.data(), LOGITS_LAST, nullptr, pool_, path_))) return rc;
            dpos = (int)ctx.size();
            for (; g < gp.gamma; g++) {
                if (g > 0 && gp.threshold > 0.f && top_probability(dl.data(), V) < gp.threshold) break;
                if (greedy) {
                    guess[g] = argmax(dl.data(), V);
                } else {
                    warp(dl.data(), V, gp.sample, &q[(size_t)g * V]);
                    guess[g] = sample(&q[(size_t)g * V], V, rng);
                }
                if (g + 1 < gp.gamma) {
                    if ((rc = draft_->forward(&guess[g], 1, dpos + g, dl.data(), LOGITS_LAST, nullptr, pool_, path_))) return rc;
                }
            }
        } else if (gp.mode == GEN_LOOKUP) {
            Timer t(stats_.t_draft);
            g = lookup(ctx, gp.ngram_max, gp.gamma, guess);
        }
        // -- verify: the pending token and the guesses in one pass -------------------------
        {
            Timer t(stats_.t_verify);
            int32_t batch[MAX_K + 1];
            batch[0] = ctx.back();
            std::copy(guess, guess + g, batch + 1);
            if ((rc = target_->forward(batch, g + 1, tpos, tl.data(), g ? LOGITS_ALL : LOGITS_LAST, nullptr, pool_, path_)))
                return rc;
        }
        // -- accept -----------------------------------------------------------------------
        Timer t(stats_.t_sample);
        const size_t before = ctx.size();
        int n_acc = 0;
        bool all = true;
        for (int i = 0; i < g && !stop; i++) {
            const float* li = &tl[(size_t)i * V];
            int32_t tok;
            bool ok;
            if (greedy) {
                tok = argmax(li, V);
                ok = tok == guess[i];
            } else {
                warp(li, V, gp.sample, p.data());
                if (gp.mode == GEN_DRAFT) {
                    tok = accept_or_resample(p.data(), &q[(size_t)i * V], V, guess[i], rng, &ok);
                } else {                           // a lookup guess is a point mass: accept with p(x)
                    ok = rng.uniform() < p[guess[i]];
                    if (ok) tok = guess[i];
                    else { p[guess[i]] = 0.f; tok = sample(p.data(), V, rng); }   // sample() renormalises
                }
            }
            if (ok) n_acc++;
            ctx.push_back(ok ? guess[i] : tok);
            stop = emit(ctx.back(), out, gp);
            if (!ok) { all = false; break; }
        }
        if (all && !stop) {                      // every guess taken: the bonus token
            const float* lb = &tl[(size_t)g * V];
            int32_t tok;
            if (greedy) tok = argmax(lb, V);
            else { warp(lb, V, gp.sample, p.data()); tok = sample(p.data(), V, rng); }
            ctx.push_back(tok);
            stop = emit(tok, out, gp);
        }
        // the target keeps pending + accepted guesses; the draft what it saw of them
        tpos += 1 + n_acc;
        if (gp.mode == GEN_DRAFT) dpos = (int)before + std::min(n_acc, g - 1);
        if (stats_.rounds < max_rounds && drafted) {
            drafted[stats_.rounds] = g;
            accepted[stats_.rounds] = n_acc;
        }
        stats_.rounds++;
        stats_.drafted += g;
        stats_.accepted += n_acc;
    }
    stats_.t_total = now() - t_start;
    return E_OK;
}

}  // namespace lab
