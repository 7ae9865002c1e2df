// generate.cpp — the round loop: plain decoding, speculative decoding with a draft model,
// prompt-lookup drafting, and the automatic policy that picks between them each round,
// all in C++ so no Python lands in a timing.
//
// Invariant at the start of every round: the target's KV cache holds every token but the
// last (`pending`); the draft's holds a prefix of them. The cost model the automatic
// policy plans with is docs/science.md §1; the acceptance rule, §4.
#include <algorithm>
#include <cmath>
#include <vector>

#include "clock.h"
#include "lab.h"
#include "threadpool.h"

namespace lab {

int lookup_ngram(const int32_t* ctx, int len, int ngram_max, int gamma, int32_t* out, int* matched) {
    *matched = 0;
    for (int n = std::min(ngram_max, len - 1); n >= 1; n--) {
        const int32_t* suffix = ctx + len - n;
        for (int s = len - n - 1; s >= 0; s--) {
            if (!std::equal(suffix, suffix + n, ctx + s)) continue;
            const int g = std::min(gamma, len - (s + n));
            std::copy(ctx + s + n, ctx + s + n + g, out);
            *matched = n;
            return g;
        }
    }
    return 0;
}

RoundPlan::RoundPlan(const Policy& p, int context, float rate_) : o(p.o), rate(rate_) {
    // costs at this context: linear between the two measured contexts around it
    int j = 0;
    while (j + 1 < p.n_ctx && p.ctx[j] < context) j++;
    const int i = j > 0 ? j - 1 : 0;
    float w = 0.f;
    if (j != i) w = std::clamp((float)(context - p.ctx[i]) / (float)(p.ctx[j] - p.ctx[i]), 0.f, 1.f);
    for (int k = 0; k < VK; k++) v[k] = (1 - w) * p.v[i * VK + k] + w * p.v[j * VK + k];
    c = (1 - w) * p.c[i] + w * p.c[j];
    cost = v[1] + o;
}

void RoundPlan::take(float a, bool draft_step) {
    cost += extra_cost(draft_step);
    reach *= a;
    tokens += reach;
    g++;
}

namespace {

int conf_bin(float p) { return std::clamp((int)(p * CAL_BINS), 0, CAL_BINS - 1); }

// A running tokens-per-target-step over the last ~10 rounds of a kind, started from a prior;
// while the kind is not chosen it drifts back toward the prior, so one bad stretch does not
// rule it out for the rest of the run.
struct Rate {
    static constexpr double KEEP = 0.9, DRIFT = 0.05;
    double prior, tokens, cost;
    explicit Rate(float p) : prior(p), tokens(4.0 * p), cost(4.0) {}
    void add(double t, double c) { tokens = KEEP * tokens + t; cost = KEEP * cost + c; }
    void idle() { tokens += DRIFT * prior; cost += DRIFT; }
    float value() const { return (float)(tokens / cost); }
};

// How often lookup's guesses are accepted in this run, started from the calibration (worth
// PRIOR guesses each): a prompt's own text can be far more or less repetitive than training's.
struct LookupOdds {
    static constexpr double PRIOR = 4.0;
    double first_hits[NGRAM_MAX + 1], first_tries[NGRAM_MAX + 1], next_hits, next_tries;
    explicit LookupOdds(const Policy* p) {
        for (int n = 0; n <= NGRAM_MAX; n++) {
            first_hits[n] = PRIOR * (p ? p->lookup_first[n] : 0.f);
            first_tries[n] = PRIOR;
        }
        next_hits = PRIOR * (p ? p->lookup_next : 0.f);
        next_tries = PRIOR;
    }
    float first(int n) const { return (float)(first_hits[n] / first_tries[n]); }
    float next() const { return (float)(next_hits / next_tries); }
    // g guesses after an n-gram match, n_acc of them accepted (the rest unseen past the first miss)
    void add(int n, int g, int n_acc) {
        first_tries[n] += 1;
        first_hits[n] += n_acc > 0;
        if (n_acc > 0) {
            next_tries += std::min(g, n_acc + 1) - 1;
            next_hits += n_acc - 1;
        }
    }
};

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
    produced_.fetch_add(1, std::memory_order_release);
    stats_.new_tokens++;
    for (int i = 0; i < gp.n_eos; i++)
        if (tok == gp.eos[i]) { stats_.stopped_on_eos = 1; return 1; }
    return produced_ >= gp.max_new_tokens;
}

int Generator::run(const int32_t* prompt, int n_prompt, const GenParams& gp, int32_t* out,
                   int32_t* drafted, int32_t* accepted, int32_t* kinds, int max_rounds) {
    stats_ = GenStats{};
    produced_ = 0;
    const bool spec = gp.mode != GEN_PLAIN, autop = gp.mode == GEN_AUTO;
    const bool use_draft = gp.mode == GEN_DRAFT || (autop && draft_);
    const Policy* pol = gp.policy;
    const int max_g = autop ? (pol ? pol->max_gamma : 0) : gp.gamma;
    if (n_prompt < 1) return E_EMPTY;
    if (autop && (!pol || pol->n_ctx < 1 || pol->n_ctx > COST_CONTEXTS)) return E_POLICY;
    if (spec && (max_g < 1 || max_g > MAX_K)) return E_GAMMA;
    if (gp.mode == GEN_DRAFT && !draft_) return E_VOCAB;
    if (use_draft && draft_->vocab() != target_->vocab()) return E_VOCAB;
    const int need = n_prompt + gp.max_new_tokens + (spec ? max_g : 0);
    if (need > target_->max_context() || (use_draft && need > draft_->max_context())) return E_CONTEXT;
    if (gp.max_new_tokens < 1) return E_OK;
    const int V = target_->vocab();
    const bool greedy = gp.sample.temperature <= 0.f, need_conf = autop || gp.threshold > 0.f;
    const double t_start = now();
    PinScope pin(pool_);
    Rng rng(gp.seed);
    std::vector<int32_t> ctx(prompt, prompt + n_prompt);
    // A trimmed draft scores its kept tokens and the prompt's own: DV logits, token dids[j].
    if (use_draft) draft_->set_extra_rows(prompt, n_prompt);
    const int DV = use_draft ? draft_->out_rows() : 0;
    const int32_t* dids = use_draft ? draft_->out_ids() : nullptr;
    std::vector<float> tl((size_t)(MAX_K + 1) * V), dl(DV), scratch(std::max(DV, 1)), p(V);
    std::vector<float> q(greedy || !use_draft ? 0 : (size_t)MAX_K * V), qc(dids && !greedy ? DV : 0);
    int tpos = n_prompt - 1, dpos = 0, rc = E_OK;

    stats_.prompt_tokens = n_prompt;
    // The request's setup (pinning, buffers, a trimmed draft's rows for the prompt) is the
    // prompt's time, not decoding's: a speculative run must not pay for it in its speedup.
    stats_.t_prompt = now() - t_start;
    if (tpos > 0) {                              // the prompt pass: target, and draft alike
        Timer t(stats_.t_prompt);
        if ((rc = target_->forward(prompt, tpos, 0, nullptr, LOGITS_NONE, nullptr, pool_, path_))) return rc;
        if (use_draft) {
            if ((rc = draft_->forward(prompt, tpos, 0, nullptr, LOGITS_NONE, nullptr, pool_, path_))) return rc;
            dpos = tpos;
        }
    }
    // The automatic policy's running estimates: tokens per target step in draft rounds and
    // overall (what a lookup guess must earn per unit of cost), and lookup's odds.
    Rate draft_rate(pol && use_draft ? pol->draft_rate : 1.f), rate(pol && use_draft ? pol->draft_rate : 1.f);
    LookupOdds odds(pol);

    // One draft guess from dl: the token, its warped distribution in q (sampling), and the
    // draft's confidence (its top probability, warped when sampling).
    auto pick = [&](int g, float* conf) -> int32_t {
        if (greedy) {
            const int j = argmax(dl.data(), DV, path_);
            *conf = need_conf ? top_probability(dl.data(), DV, scratch.data(), path_) : 1.f;
            return dids ? dids[j] : j;
        }
        float* qg = &q[(size_t)g * V];
        float* w = dids ? qc.data() : qg;
        warp(dl.data(), DV, gp.sample, w, path_);
        const int j = sample(w, DV, rng, path_);
        *conf = *std::max_element(w, w + DV);
        if (dids)
            for (int i = 0; i < DV; i++) qg[dids[i]] = w[i];     // q is 0 off the trimmed set
        return dids ? dids[j] : j;
    };

    int32_t guess[MAX_K], lguess[MAX_K];
    bool stop = false;
    while (!stop) {
        int g = 0, kind = ROUND_PLAIN, matched = 0;
        // A draft round's guesses must earn what draft rounds make per step.
        static const Policy no_policy{};
        RoundPlan plan(pol ? *pol : no_policy, (int)ctx.size(), draft_rate.value());
        // -- choose, in the automatic policy, the kind of round expected to make the most
        // tokens per step: lookup as planned from its odds, the draft as its rounds have
        // made, or a plain step -------------------------------------------------------------
        bool draft_now = gp.mode == GEN_DRAFT, lookup_now = gp.mode == GEN_LOOKUP;
        if (autop) {
            Timer t(stats_.t_draft);
            const int gl = lookup_ngram(ctx.data(), (int)ctx.size(), std::clamp(pol->ngram_max, 1, NGRAM_MAX), max_g,
                                        lguess, &matched);
            RoundPlan lp(*pol, (int)ctx.size(), rate.value());
            matched = std::min(matched, NGRAM_MAX);
            for (int i = 0; i < gl; i++) {
                const float a = i ? odds.next() : odds.first(matched);
                if (!lp.worth(a, false)) break;
                lp.take(a, false);
            }
            const float e_plain = 1.f / plan.cost, e_lookup = lp.g ? lp.efficiency() : 0.f;
            const float e_draft = use_draft ? draft_rate.value() : 0.f;
            if (lp.g && e_lookup >= std::max(e_draft, e_plain)) {
                g = lp.g;
                std::copy(lguess, lguess + g, guess);
                plan = lp;
                kind = ROUND_LOOKUP;
            } else {
                draft_now = e_draft > e_plain;
            }
            if (use_draft && !draft_now) draft_rate.idle();
        }
        // -- draft ------------------------------------------------------------------------
        if (draft_now) {
            Timer t(stats_.t_draft);
            kind = ROUND_DRAFT;
            int n_in = (int)ctx.size() - dpos;         // catch up, the pending token included
            const int32_t* in = ctx.data() + dpos;
            float a_next = 0.f;                        // the next guess's odds, from this one's confidence
            for (; g < max_g; g++) {
                if (g > 0) {                           // one more draft step: worth it?
                    if (autop && !plan.worth(a_next, true)) break;
                    in = &guess[g - 1];
                    n_in = 1;
                }
                const int at = g == 0 ? dpos : dpos + g - 1;   // dpos moved past the catch-up
                if ((rc = draft_->forward(in, n_in, at, dl.data(), LOGITS_LAST, nullptr, pool_, path_)))
                    return rc;
                if (g == 0) dpos = (int)ctx.size();
                float conf;
                const int32_t tok = pick(g, &conf);
                if (g > 0 && gp.threshold > 0.f && conf < gp.threshold) break;
                if (autop) {
                    const float a = pol->draft_p[conf_bin(conf)];
                    if (g > 0 && !plan.worth(a, false)) break;   // its step is paid; is its verification?
                    plan.take(a, true);
                    a_next = pol->draft_next[conf_bin(conf)];
                }
                guess[g] = tok;
            }
        } else if (lookup_now) {
            Timer t(stats_.t_draft);
            g = lookup_ngram(ctx.data(), (int)ctx.size(), gp.ngram_max, gp.gamma, guess, &matched);
            kind = g ? ROUND_LOOKUP : ROUND_PLAIN;
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
                tok = argmax(li, V, path_);
                ok = tok == guess[i];
            } else {
                warp(li, V, gp.sample, p.data(), path_);
                if (kind == ROUND_DRAFT) {
                    tok = accept_or_resample(p.data(), &q[(size_t)i * V], V, guess[i], rng, &ok, path_);
                } else {                           // a lookup guess is a point mass: accept with p(x)
                    ok = rng.uniform() < p[guess[i]];
                    if (ok) tok = guess[i];
                    else { p[guess[i]] = 0.f; tok = sample(p.data(), V, rng, path_); }   // sample() renormalises
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
            if (greedy) tok = argmax(lb, V, path_);
            else { warp(lb, V, gp.sample, p.data(), path_); tok = sample(p.data(), V, rng, path_); }
            ctx.push_back(tok);
            stop = emit(tok, out, gp);
        }
        if (kind == ROUND_DRAFT && dids && !greedy)      // back to zero off the set for the next round
            for (int i = 0; i < g; i++)
                for (int j = 0; j < DV; j++) q[(size_t)i * V + dids[j]] = 0.f;
        // the target keeps pending + accepted guesses; the draft what it saw of them
        tpos += 1 + n_acc;
        if (kind == ROUND_DRAFT) dpos = (int)before + std::min(n_acc, g - 1);
        if (autop) {
            const double made = (double)(ctx.size() - before);
            const double cost = (kind == ROUND_DRAFT ? g * plan.c : 0.0) + plan.v[g + 1] + plan.o;
            rate.add(made, cost);
            if (kind == ROUND_DRAFT) draft_rate.add(made, cost);
            if (kind == ROUND_LOOKUP) odds.add(matched, g, n_acc);
        }
        if (stats_.rounds < max_rounds && drafted) {
            drafted[stats_.rounds] = g;
            accepted[stats_.rounds] = n_acc;
            if (kinds) kinds[stats_.rounds] = kind;
        }
        stats_.rounds++;
        stats_.drafted += g;
        stats_.accepted += n_acc;
    }
    stats_.t_total = now() - t_start;
    return E_OK;
}

}  // namespace lab
