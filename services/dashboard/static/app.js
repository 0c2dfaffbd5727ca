// Polar dashboard: vanilla JS, no build step, no CDN. Every value from the stack is put
// in the page as text (textContent / attributes), never parsed as HTML.
"use strict";

const body = document.body;
const PAGE = body.dataset.page;
const main = document.getElementById("main");
const STATE_ORDER = ["REGISTERED", "INITIALIZING", "READY", "RUNNING", "POSTRUN", "BUILDING",
  "EVALUATING", "COMPLETED", "TIMEOUT", "ERROR", "CANCELLED"];

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") node.className = v;
    else if (k === "style") node.style.cssText = v; // CSSOM: allowed by the page's CSP
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat(Infinity)) {
    if (c === null || c === undefined || c === false) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}
const fmt = (x, d = 3) => (x === null || x === undefined ? "–" : typeof x === "number" ? (Number.isInteger(x) ? String(x) : x.toFixed(d)) : String(x));
const num = (x) => (typeof x === "number" && x !== 0 && Math.abs(x) < 0.01 ? x.toExponential(2) : fmt(x)); // a logprob mismatch is ~1e-5
const secs = (x) => (x === null || x === undefined ? "–" : x < 1 ? `${(x * 1000).toFixed(0)} ms` : `${x.toFixed(2)} s`);
const stateTag = (s) => el("span", { class: `state st-${s}` }, s);
const link = (href, text) => el("a", { href }, text);
const enc = encodeURIComponent;

function banner(problems) {
  const b = document.getElementById("banner");
  if (problems && problems.length) {
    b.replaceChildren(el("strong", {}, "Stack problem: "), problems.join(" · "));
    b.hidden = false;
  } else {
    b.hidden = true;
  }
}

async function api(path, opts) {
  let r;
  try {
    // a stalled read must not hold the page's renders forever (a failed render is tried
    // again); a cancel waits longer: it may have gone through on a slow stack
    const ms = opts && opts.method === "POST" ? 60000 : 20000;
    r = await fetch(path, Object.assign({ signal: AbortSignal.timeout(ms) }, opts || {}));
  } catch (e) {
    banner([`the dashboard itself is unreachable (${e})`]);
    throw e;
  }
  const data = await r.json().catch(() => ({}));
  if (!r.ok) {
    const err = new Error(data.detail || `HTTP ${r.status}`);
    err.status = r.status;
    throw err;
  }
  banner(data.problems);
  return data;
}

function table(headers, rows, attrs) {
  return el("table", attrs || {},
    el("thead", {}, el("tr", {}, headers.map((h) => el("th", {}, h)))),
    el("tbody", {}, rows));
}

function section(title, ...children) {
  return el("section", {}, el("h2", {}, title), ...children);
}

// tool-call parse health (services/dashboard/toolparse.py): "N parsed, M failed (kinds)"
function toolLine(tp) {
  const kinds = Object.entries(tp.kinds).map(([k, n]) => `${k} ×${n}`).join(", ");
  return `tool calls: ${tp.parsed} parsed, ${tp.failed} failed${kinds ? ` (${kinds})` : ""}`;
}

function toolFailures(failures, where) {
  return el("ul", { class: "tool-failures" }, failures.map((f) => el("li", { class: "tool-failure", "data-kind": f.kind },
    f.seq === undefined ? "" : `call ${f.seq}: `, el("b", {}, f.kind), ` — ${f.detail} · `,
    el("span", { class: "span" }, f.start < 0 ? "the whole call" : `${where} tokens [${f.start}, ${f.end})`))));
}

function stateBar(counts, total) {
  const bar = el("div", { class: "statebar", title: STATE_ORDER.filter((s) => counts[s]).map((s) => `${s}: ${counts[s]}`).join(", ") });
  for (const s of STATE_ORDER) {
    const n = counts[s] || 0;
    if (!n) continue;
    bar.append(el("span", { class: `seg st-${s}`, style: `width:${(100 * n) / Math.max(total, 1)}%` }));
  }
  return bar;
}

// -- the sessions table: server-side filters and pages -------------------------------
const FILTERS = ["task", "state", "reward_min", "reward_max", "reason", "harness"];

function sessionsTable(fixed) {
  const wrap = el("div", { class: "sessions" });
  const q = Object.assign({ offset: 0, limit: 25 }, fixed || {});
  const form = el("form", { class: "filters", id: "filters" });
  for (const f of FILTERS) {
    if (fixed && f in fixed) continue;
    form.append(el("label", {}, f.replace("_", " "), el("input", { name: f, id: `f-${f}`, size: f.startsWith("reward") ? 4 : 12 })));
  }
  form.append(el("button", { type: "submit" }, "filter"));
  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    for (const f of FILTERS) {
      const input = form.elements[f];
      if (input) q[f] = input.value;
    }
    q.offset = 0;
    load();
  });
  const out = el("div");
  const pager = el("div", { class: "pager" });
  wrap.append(form, out, pager);

  async function load() {
    const params = new URLSearchParams(Object.entries(q).filter(([, v]) => v !== "" && v !== undefined));
    let data;
    try {
      data = await api(`/api/sessions?${params}`);
    } catch (e) {
      out.replaceChildren(el("p", { class: "error" }, String(e.message)));
      return;
    }
    const page = data.page;
    out.replaceChildren(table(["session", "state", "harness", "node", "reward", "reason"],
      page.rows.map((r) => el("tr", { "data-session": r.session_id },
        el("td", {}, link(`/sessions/${enc(r.session_id)}`, r.session_id)),
        el("td", {}, stateTag(r.state)),
        el("td", {}, r.harness || "–"),
        el("td", {}, r.node || "–"),
        el("td", { class: "num" }, fmt(r.reward)),
        el("td", { class: "reason" }, r.cause || ""))),
      { id: "sessions-table" }));
    const last = Math.min(page.offset + page.limit, page.total);
    pager.replaceChildren(
      el("button", { disabled: page.offset === 0, onclick: () => { q.offset = Math.max(0, q.offset - q.limit); load(); } }, "‹ prev"),
      el("span", { id: "sessions-range" }, ` ${page.total ? page.offset + 1 : 0}–${last} of ${page.total} `),
      el("button", { disabled: last >= page.total, onclick: () => { q.offset += q.limit; load(); } }, "next ›"));
  }
  wrap.refresh = load;
  load();
  return wrap;
}

// -- pages ----------------------------------------------------------------------------
const pages = {};

const TASKS_PER_PAGE = 20;
let tasksOffset = 0; // the overview's page of tasks: kept across live re-renders

function tasksPager(t) {
  const last = Math.min(t.offset + t.rows.length, t.total);
  const go = (offset) => { tasksOffset = Math.max(0, offset); render(); };
  return el("div", { class: "pager", id: "tasks-pager" },
    el("button", { id: "tasks-prev", disabled: t.offset === 0, onclick: () => go(t.offset - TASKS_PER_PAGE) }, "‹ prev"),
    el("span", { id: "tasks-range" }, ` ${t.total ? t.offset + 1 : 0}–${last} of ${t.total} `),
    el("button", { id: "tasks-next", disabled: last >= t.total, onclick: () => go(t.offset + TASKS_PER_PAGE) }, "next ›"));
}

pages.overview = async function () {
  let d = await api(`/api/overview?offset=${tasksOffset}&limit=${TASKS_PER_PAGE}`);
  if (tasksOffset && tasksOffset >= d.tasks.total) { // tasks went away: the last page there is
    tasksOffset = Math.max(0, Math.floor((d.tasks.total - 1) / TASKS_PER_PAGE) * TASKS_PER_PAGE);
    d = await api(`/api/overview?offset=${tasksOffset}&limit=${TASKS_PER_PAGE}`);
  }
  const cards = el("div", { class: "cards" },
    el("div", { class: "card" }, el("b", { id: "n-sessions" }, d.sessions), " sessions"),
    el("div", { class: "card" }, el("b", { id: "rate" }, fmt(d.sessions_per_second, 2)), " sessions/s (1 min)"),
    el("div", { class: "card" }, el("b", {}, fmt(d.reward_mean)), ` mean reward (${d.rewarded})`),
    el("div", { class: "card" }, el("b", {}, d.backpressure === null ? "?" : d.backpressure ? "ON" : "off"), " engine backpressure"));
  const tasks = table(["task", "harness", "progress", "done", "reward", ""],
    d.tasks.rows.map((t) => el("tr", { "data-task": t.task_id },
      el("td", {}, link(`/tasks/${enc(t.task_id)}`, t.task_id)),
      el("td", {}, t.harness || "–"),
      el("td", {}, stateBar(t.counts, t.sessions)),
      el("td", { class: "num" }, `${t.done}/${t.sessions}`),
      el("td", { class: "num" }, fmt(t.reward_mean)),
      el("td", {}, t.live ? "live" : ""))),
    { id: "tasks-table" });
  const nodes = d.nodes === null ? el("p", { class: "error" }, "unknown: Redis unreachable")
    : table(["node", "stage", "use / bound", ""], d.nodes.flatMap((n) => Object.entries(n.stages).map(([stage, v]) =>
      el("tr", {}, el("td", {}, n.node), el("td", {}, stage), el("td", { class: "num" }, `${v.used} / ${v.bound ?? "–"}`),
        el("td", {}, el("meter", { min: 0, max: v.bound || 1, value: v.used }))))), { id: "nodes-table" });
  const engines = d.engines.length ? table(["engine", "kind", "queue", "up"], d.engines.map((e) =>
    el("tr", {}, el("td", {}, e.name), el("td", {}, e.kind || "–"), el("td", { class: "num" }, fmt(e.queue)), el("td", {}, e.up === null ? "–" : e.up ? "yes" : "NO"))))
    : el("p", { class: "muted" }, "no engines: the topology lists no backends and the stack runs no model service");
  const streams = d.streams === null ? el("p", { class: "error" }, "unknown: NATS unreachable")
    : table(["stream", "messages", "consumer", "pending", "ack pending", "redelivered"], d.streams.flatMap((s) =>
      (s.consumers.length ? s.consumers : [null]).map((c) => el("tr", {},
        el("td", {}, s.name), el("td", { class: "num" }, fmt(s.messages)),
        el("td", {}, c ? c.name : "–"), el("td", { class: "num" }, c ? c.pending : "–"),
        el("td", { class: "num" }, c ? c.ack_pending : "–"), el("td", { class: "num" }, c ? c.redelivered : "–")))), { id: "streams-table" });
  const errors = d.errors.length ? table(["reason", "sessions"], d.errors.map((e) => el("tr", {}, el("td", { class: "reason" }, e.reason), el("td", { class: "num" }, e.count))), { id: "errors-table" })
    : el("p", { class: "muted", id: "errors-table" }, "no errors");
  const states = el("div", { id: "states" }, stateBar(d.states, d.sessions), el("div", { class: "legend" },
    STATE_ORDER.filter((s) => d.states[s]).map((s) => el("span", {}, stateTag(s), ` ${d.states[s]} `))));
  if (!pages.overview.sessions) pages.overview.sessions = sessionsTable();
  else pages.overview.sessions.refresh();
  main.replaceChildren(el("h1", {}, "Overview"), cards, states,
    section(`Tasks (${d.tasks.total})`, tasks, tasksPager(d.tasks)),
    el("div", { class: "cols" }, section("Nodes", nodes), section("Engines", engines)),
    section("Stream backlogs", streams), section("Errors by reason", errors),
    section("Sessions", pages.overview.sessions));
};

const TOKEN_KEY = "polar-admin-token";
let cancelMessage = ""; // what the last cancel answered: kept across live re-renders

pages.task = async function () {
  const id = body.dataset.task;
  const d = await api(`/api/tasks/${enc(id)}`);
  settled = d.settled; // every session ended and its reward read: nothing more will change
  // a live task up to now; a finished one over its own span (timeline_end)
  const t0 = d.timeline_start, span = Math.max(d.timeline_end - t0, 0.001);
  const axis = el("div", { class: "tl-axis", id: "timeline-axis" }, el("span", { class: "tl-label" }, "elapsed"),
    el("span", { class: "tl-bar" }, d.axis.map((t) => el("span", { class: "tick", style: `left:${(100 * t.at) / span}%` }, t.label))));
  const timeline = el("div", { class: "timeline", id: "timeline" }, axis, d.timelines.map((tl) =>
    el("div", { class: "tl-row", "data-session": tl.session_id },
      el("span", { class: "tl-label" }, link(`/sessions/${enc(tl.session_id)}`, tl.session_id.slice(-4)), " ", stateTag(tl.state)),
      el("span", { class: "tl-bar" }, tl.spans.map((s) => el("span", {
        class: `phase ph-${s.phase}`,
        style: `left:${(100 * (s.start - t0)) / span}%;width:${Math.max((100 * (s.end - s.start)) / span, 0.3)}%`,
        title: `${s.state}: ${secs(s.seconds)}`,
      }))))));
  const legend = el("div", { class: "legend" }, ["queued", "init", "ready", "running", "postrun", "building", "evaluating"].map((p) => el("span", {}, el("span", { class: `swatch ph-${p}` }), ` ${p} `)));
  const group = table(["#", "session", "state", "outcome", "reward", "length", "sampled", "turns", "chains", "tool calls failed", "reason"],
    d.group.map((m) => el("tr", {}, el("td", {}, m.index), el("td", {}, link(`/sessions/${enc(m.session_id)}`, m.session_id)),
      el("td", {}, stateTag(m.state)), el("td", {}, m.outcome || "–"), el("td", { class: "num reward" }, fmt(m.reward)),
      el("td", { class: "num" }, fmt(m.length)), el("td", { class: "num" }, fmt(m.sampled_tokens)), el("td", { class: "num" }, fmt(m.turns)),
      el("td", { class: "num" }, fmt(m.chains)),
      el("td", { class: m.tool_parse && m.tool_parse.failed ? "num tool-failed" : "num" }, m.tool_parse ? `${m.tool_parse.failed}/${m.tool_parse.parsed + m.tool_parse.failed}` : "–"),
      el("td", { class: "reason" }, m.reason || ""))), { id: "group-table" });
  const cancel = el("button", { id: "cancel", class: "danger", disabled: !d.live, onclick: async () => {
    // a cancel changes what runs: it takes the stack's admin token, asked once per tab
    const token = sessionStorage.getItem(TOKEN_KEY)
      || window.prompt(`Cancel every live session of ${id}? The stack's admin token (admin_token in <state_dir>/credentials.json):`);
    if (!token) return;
    try {
      const r = await api(`/api/tasks/${enc(id)}/cancel`, { method: "POST", headers: { Authorization: `Bearer ${token}` } });
      sessionStorage.setItem(TOKEN_KEY, token);
      cancelMessage = r.message;
    } catch (e) {
      sessionStorage.removeItem(TOKEN_KEY);
      cancelMessage = `cancel failed: ${e.message}`;
    }
    const shown = document.getElementById("cancel-result"); // gone if a render failed meanwhile
    if (shown) shown.textContent = cancelMessage;
  } }, "Cancel task");
  if (!pages.task.sessions) pages.task.sessions = sessionsTable({ task: id });
  else pages.task.sessions.refresh();
  main.replaceChildren(
    el("h1", {}, "Task ", el("code", { id: "task-id" }, id), " ", d.live ? el("span", { class: "badge" }, "live") : ""),
    el("p", {}, `${d.done}/${d.sessions} done · builder ${d.builder || "–"} · evaluator ${d.evaluator || "–"} · mean reward ${fmt(d.reward_mean)} `, cancel, " ", el("span", { id: "cancel-result" }, cancelMessage)),
    d.tool_parse ? el("p", { id: "tool-parse", class: d.tool_parse.failed ? "warn" : "" }, `${toolLine(d.tool_parse)} · ${d.tool_parse.sessions_failed} of ${d.tool_parse.sessions} sessions with a failed tool call`) : "",
    d.instruction ? el("pre", { class: "instruction" }, d.instruction.text) : "",
    stateBar(d.counts, d.sessions),
    section("Timeline", legend, timeline),
    section("GRPO group", d.no_variance ? el("p", { class: "warn", id: "no-variance" }, "every reward in this group is equal: no advantage to learn from") : "", group),
    section("Sessions", pages.task.sessions));
};

function textBlock(title, clipped, attrs) {
  if (!clipped || !clipped.text) return el("div", attrs || {}, el("h3", {}, title), el("p", { class: "muted" }, "(empty)"));
  return el("div", attrs || {}, el("h3", {}, title), el("pre", {}, clipped.text),
    clipped.cut ? el("p", { class: "muted" }, `… ${clipped.cut} more characters not shown`) : "");
}

pages.session = async function () {
  const id = body.dataset.session;
  const d = await api(`/api/sessions/${enc(id)}`);
  const s = d.session, v = d.verdict;
  settled = d.settled; // ended, its reward and artifacts read: nothing more will change
  // the routing column only where an MoE engine returned routing: dense sessions' pages are as they were
  const headers = ["seq", "protocol", "side call", "tokens in", "tokens out", "engine ms", "proxy ms", "weights", "extends", "drift / break", "finish"]
    .concat(d.routing ? ["routing"] : [])
    .concat(d.replay_column ? ["replay"] : []); // only a replay's session (polar replay) has this column
  const calls = table(headers,
    d.calls.flatMap((c) => {
      const diverged = c.replay && (c.replay.kind === "diverged" || c.replay.kind === "refused");
      const row = el("tr", { class: diverged ? "call diverged" : "call", "data-seq": c.seq },
        el("td", {}, c.seq), el("td", {}, c.protocol), el("td", {}, c.side_call || "–"),
        el("td", { class: "num" }, fmt(c.tokens_in)), el("td", { class: "num" }, c.tokens_out),
        el("td", { class: "num" }, fmt(c.engine_ms, 1)), el("td", { class: "num" }, fmt(c.proxy_ms, 1)),
        el("td", {}, c.weight_version || "–"), el("td", {}, c.extends_previous === null ? "–" : c.extends_previous ? "yes" : "no"),
        el("td", { class: "reason" }, c.drift_reason || ""), el("td", {}, c.error ? `error: ${c.error}` : c.finish_reason,
          c.tool_parse && c.tool_parse.failed ? el("span", { class: "badge warn tool-failed" }, ` ${c.tool_parse.failed} tool call${c.tool_parse.failed > 1 ? "s" : ""} failed`) : ""),
        d.routing ? el("td", { class: "routing" }, c.routing ? c.routing.line : "—") : "",
        d.replay_column ? el("td", { class: "replay" }, replayCell(c.replay)) : "");
      const detail = el("tr", { class: "call-detail", hidden: true }, el("td", { colspan: headers.length },
        el("div", { class: "sidebyside" }, textBlock("harness's request", c.request), textBlock("what the engine received (normalized)", c.engine_request)),
        textBlock("reply", c.reply),
        c.tool_calls.length ? el("div", {}, el("h3", {}, "tool calls"), c.tool_calls.map((t) => el("pre", {}, `${t.name}(${t.arguments})`))) : "",
        c.tool_results.length ? el("div", {}, el("h3", {}, "tool results in this request"), c.tool_results.map((t) => el("pre", {}, t.content.text))) : "",
        c.tool_parse ? el("div", { class: "call-tool-parse" }, el("h3", {}, `tool-call parse (${c.tool_parse.family || "?"} parser)`), el("p", {}, toolLine(c.tool_parse)),
          c.tool_parse.failures.length ? toolFailures(c.tool_parse.failures, "output") : "") : ""));
      row.addEventListener("click", () => { detail.hidden = !detail.hidden; });
      return [row, detail];
    }), { id: "calls-table" });
  const a = d.artifacts;
  const artifacts = a ? el("div", { id: "artifacts" },
    el("p", {}, `harness ${a.harness || "–"} ${a.harness_version || ""} · protocol ${a.protocol || "–"} · exit code ${fmt(a.exit_code)}`),
    textBlock("workdir diff", a.diff, { id: "diff" }),
    el("div", { class: "sidebyside" }, textBlock("stdout (tail)", a.stdout_tail, { id: "stdout" }), textBlock("stderr (tail)", a.stderr_tail, { id: "stderr" })),
    Object.entries(a.logs).map(([name, text]) => textBlock(`log: ${name}`, text)),
    Object.entries(a.files).map(([name, text]) => textBlock(`file: ${name}`, text)))
    : el("p", { class: "muted", id: "artifacts" }, "no artifacts seen (they are on the bus only while the session finishes; the dashboard was not running then, or the session has not finished)");
  main.replaceChildren(
    el("h1", {}, "Session ", el("code", { id: "session-id" }, s.session_id), " ", stateTag(s.state)),
    el("p", {}, "task ", link(`/tasks/${enc(s.task_id)}`, s.task_id), ` · attempt ${s.attempt} · node ${s.node || "–"} · harness ${s.harness || "–"} · `,
      link(`/sessions/${enc(s.session_id)}/trajectory`, "trajectory viewer →")),
    d.replay ? el("p", { id: "replay", class: d.replay.diverged_at === null ? "" : "warn" }, "replay of ", link(`/sessions/${enc(d.replay.of)}`, d.replay.of),
      d.replay.line.slice(`replay of ${d.replay.of}`.length)) : "",
    d.failure ? failureSection(d.failure) : "",
    lineageSection(d.lineage),
    section("Verdict", el("p", { id: "verdict" }, `reward ${fmt(v.reward)} · ${v.eval_status || "not evaluated"} · `, el("span", { class: "reason" }, v.eval_reason || ""),
      v.reason ? el("span", {}, ` · run: ${v.reason}`) : "")),
    section("Phases", el("p", {}, d.spans.map((p) => el("span", { class: `chip ph-${p.phase}` }, `${p.state} ${secs(p.seconds)}`)))),
    section(`Model calls (${d.calls.length}) — click a row for the request, reply and tools`, d.problems.length ? el("p", { class: "warn" }, d.problems.join("; ")) : "",
      d.tool_parse ? el("p", { id: "tool-parse", class: d.tool_parse.failed ? "warn" : "" }, toolLine(d.tool_parse),
        d.tool_parse.failed_calls.length ? ` · failed in call${d.tool_parse.failed_calls.length > 1 ? "s" : ""} ${d.tool_parse.failed_calls.join(", ")}` : "") : "",
      calls),
    section("Artifacts", artifacts),
    d.trajectory ? section("Build", el("pre", {}, JSON.stringify({ builder: d.trajectory.builder, intact: d.trajectory.intact, stats: d.trajectory.stats, metadata: d.trajectory.metadata }, null, 2))) : "");
};

// a recorded session's replays and forks (polar replay) and re-grades (polar regrade)
function lineageSection(l) {
  if (!l || (!l.replays.length && !l.regrades.length)) return "";
  const replays = l.replays.length ? table(["replay", "kind", "state", "reward", "graded by", "diverged"], l.replays.map((r) =>
    el("tr", { class: r.diverged ? "warn" : "" }, el("td", {}, link(`/sessions/${enc(r.session_id)}`, r.session_id)), el("td", {}, r.kind),
      el("td", {}, r.state ? stateTag(r.state) : "–"), el("td", {}, fmt(r.reward)), el("td", {}, r.evaluator),
      el("td", { class: "reason" }, r.diverged || "–"))), { id: "replays" }) : "";
  const regrades = l.regrades.length ? table(["re-grade", "evaluator", "reward", "via", "reason"], l.regrades.map((g) =>
    el("tr", { class: g.status === "ok" ? "" : "warn" }, el("td", {}, el("code", {}, g.regrade_id)), el("td", {}, g.evaluator), el("td", {}, fmt(g.reward)),
      el("td", {}, g.replay_session ? ["replay ", link(`/sessions/${enc(g.replay_session)}`, g.replay_session)] : g.via),
      el("td", { class: "reason" }, g.reason || ""))), { id: "regrades" }) : "";
  return section("Replays and re-grades", replays, regrades);
}

// a call of a replay: "replayed #3 of S" (S links to the recorded session), why its
// request differed where it did, or "diverged" (the call's error says how)
function replayCell(r) {
  if (!r) return "—";
  if (r.kind !== "replayed") return r.line;
  const tail = r.line.slice(`replayed #${r.seq} of ${r.session_id}`.length);
  return [`replayed #${r.seq} of `, link(`/sessions/${enc(r.session_id)}`, r.session_id), tail];
}

// why a session failed, timed out or was cancelled: the run's reason (the harness's exit
// code and error line), the evaluator's, and the end of the harness's stderr
function failureSection(f) {
  const why = f.reason || f.eval_reason || "no reason given";
  return section(`Why it ended ${f.state}`, el("div", { id: "failure", class: "failure" },
    el("p", {}, el("b", { class: "reason", id: "failure-reason" }, why)),
    f.reason && f.eval_reason ? el("p", { class: "muted" }, `evaluator: ${f.eval_reason}`) : "",
    el("p", { id: "failure-exit" }, `exit code ${fmt(f.exit_code)}`),
    f.stderr ? el("div", {}, el("h3", {}, "stderr (last lines)"), el("pre", { id: "failure-stderr" }, f.stderr))
      : el("p", { class: "muted", id: "failure-stderr" }, f.artifacts ? "stderr: (empty)" : "stderr: not seen (the harness's output is on the bus only while the session finishes)")));
}

// the chain a trace branched from; a side call made before the main loop began came from
// none (the builder files it under the first chain, which started after it)
function lineageOf(t) {
  const l = t.lineage;
  if (!l) return el("span", { class: "lineage" }, "–");
  if (l.later) return [el("span", { class: "lineage" }, "–"), el("span", { class: "muted lineage-note" }, ` (made before the main loop; filed under chain ${l.chain_id ?? l.trace_id}, which began after it)`)];
  return el("span", { class: "lineage", title: l.chain_id === null ? "" : `chain ${l.chain_id}` }, l.trace_id);
}

function heat(lp) {
  // probability of the sampled token: red (unlikely) to green (certain)
  if (lp === null || lp === undefined) return "";
  const p = Math.exp(lp);
  return `background:hsl(${Math.round(120 * p)},70%,85%)`;
}

pages.trajectory = async function () {
  const id = body.dataset.session;
  const view = new URLSearchParams(location.search).get("view") || "stored";
  const d = await api(`/api/sessions/${enc(id)}/trajectory?view=${enc(view)}`);
  const switcher = el("div", { class: "switch", id: "views" }, d.views.map((v) =>
    el("a", { href: `?view=${v}`, class: v === d.view ? "on" : "", "data-view": v }, v)));
  const legend = el("p", { class: "legend" }, el("span", { class: "tok m1" }, "sampled (loss)"), " ", el("span", { class: "tok m0" }, "masked (no loss)"),
    " logprob: ", el("span", { class: "tok m1", style: heat(Math.log(0.05)) }, "p=0.05"), el("span", { class: "tok m1", style: heat(Math.log(0.5)) }, "p=0.5"),
    el("span", { class: "tok m1", style: heat(0) }, "p=1"), " ", el("span", { class: "vmark" }, "v"), " weight version starts ",
    el("span", { class: "tok m1 tf" }, "tool call that did not parse"), " ",
    // routing presence (R3) is one more token class, shown only while the toggle is on
    el("label", { id: "routing-toggle" }, el("input", { type: "checkbox", checked: body.classList.contains("show-routing"),
      onchange: (ev) => body.classList.toggle("show-routing", ev.target.checked) }), " routing: "),
    el("span", { class: "tok m1 nr" }, "no routing"));
  const traces = d.traces.map((t) => {
    let version = null;
    const tp = t.tool_parse;
    const failedAt = (i) => (tp ? tp.failures.find((f) => f.start <= i && i < f.end) : undefined);
    const routedAt = (i) => t.routing.present.some(([a, b]) => a <= i && i < b);
    const toks = el("div", { class: "tokens" }, t.tokens.map(([text, mask, lp, ver, tid], i) => {
      const out = [];
      if (ver !== null && ver !== version) { out.push(el("span", { class: "vmark", title: `weights ${ver}` }, `v${ver}`)); version = ver; }
      const f = failedAt(i);
      const routed = routedAt(i);
      out.push(el("span", { class: `tok m${mask}${f ? " tf" : ""}${routed ? "" : " nr"}`, style: mask ? heat(lp) : "", title: `id ${tid} · ${mask ? "sampled" : "masked"} · logprob ${lp === null ? "–" : lp.toFixed(4)} · weights ${ver ?? "–"}${routed ? "" : " · no routing"}${f ? ` · tool call failed: ${f.kind}` : ""}` }, text));
      return out;
    }));
    return el("article", { class: "trace", "data-trace": t.trace_id, "data-chain": t.chain_id },
      el("h3", {}, `chain ${t.chain_id} `, t.side_call ? el("span", { class: "badge" }, `side call: ${t.side_call}`) : "",
        t.trainable ? "" : el("span", { class: "badge warn" }, "not trainable")),
      el("p", { class: "chain-meta" },
        "break reason: ", el("b", { class: "break-reason" }, t.break_reason || "–"),
        " · lineage: ", lineageOf(t),
        ` · reward ${fmt(t.reward)} · prompt ${t.prompt_tokens} tokens · response ${t.response_tokens} (${t.sampled_tokens} sampled) · calls ${t.completion_seqs.join(", ")}`),
      el("p", { class: "routing-line" }, t.routing.line),
      tp ? el("p", { class: tp.failed ? "tool-parse warn" : "tool-parse" }, toolLine(tp)) : "",
      tp && tp.failures.length ? toolFailures(tp.failures, "response") : "",
      el("details", {}, el("summary", {}, "prompt"), el("pre", {}, t.prompt.text)),
      toks, t.tokens_cut ? el("p", { class: "muted" }, `… ${t.tokens_cut} more tokens not shown`) : "");
  });
  main.replaceChildren(el("h1", {}, "Trajectory ", el("code", {}, id)),
    el("p", {}, link(`/sessions/${enc(id)}`, "← session"), d.decoded ? "" : " · no tokenizer configured: token ids shown"),
    switcher, legend, d.note ? el("p", { class: "warn", id: "note" }, d.note) : "",
    ...(d.traces.length ? traces : [el("p", { class: "muted", id: "no-traces" }, "no traces")]));
};

function chart(name, label, points) {
  const W = 360, H = 160, P = 28, L = 60; // L: room for the value labels left of the plot
  const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.setAttribute("class", "chart");
  const fig = el("figure", { "data-curve": name }, el("figcaption", {}, points.length ? `${label}: ${num(points[points.length - 1][1])} at step ${points[points.length - 1][0]} (${points.length} ${points.length === 1 ? "point" : "points"})` : `${label} (no points)`), svg);
  if (!points.length) return fig;
  const xs = points.map((p) => p[0]), ys = points.map((p) => p[1]);
  const x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(...ys), y1 = Math.max(...ys);
  const sx = (x) => L + ((x - x0) / Math.max(x1 - x0, 1e-9)) * (W - L - P);
  const sy = (y) => H - P - ((y - y0) / Math.max(y1 - y0, 1e-9)) * (H - 2 * P);
  const path = document.createElementNS("http://www.w3.org/2000/svg", "polyline");
  path.setAttribute("points", points.map((p) => `${sx(p[0])},${sy(p[1])}`).join(" "));
  path.setAttribute("class", "line");
  svg.append(path);
  for (const p of points) {
    const dot = document.createElementNS("http://www.w3.org/2000/svg", "circle");
    dot.setAttribute("cx", sx(p[0])); dot.setAttribute("cy", sy(p[1])); dot.setAttribute("r", 2.5);
    dot.setAttribute("class", "dot");
    svg.append(dot);
  }
  for (const [txt, x, y] of [[num(y1), 2, P + 4], [num(y0), 2, H - P + 4], [`step ${x0}`, L - 10, H - 6], [`step ${x1}`, W - P - 30, H - 6]]) {
    const t = document.createElementNS("http://www.w3.org/2000/svg", "text");
    t.setAttribute("x", x); t.setAttribute("y", y); t.textContent = txt;
    svg.append(t);
  }
  return fig;
}

pages.training = async function () {
  const d = await api("/api/training");
  if (!d.configured) {
    main.replaceChildren(el("h1", {}, "Training"), el("p", { class: "muted", id: "no-trainer" }, "no trainer in this stack (its JSONL log is not configured)"));
    return;
  }
  const state = d.state === "done" ? el("span", { class: "badge done", id: "train-state" }, `done at step ${fmt(d.last_step)}`)
    : d.state === "failed" ? el("span", { class: "badge failed", id: "train-state" }, `failed: ${d.detail || "no reason given"}`)
      : el("span", { class: "badge", id: "train-state" }, "running");
  main.replaceChildren(el("h1", {}, "Training ", state), el("p", { id: "train-steps" }, `${d.steps} steps`),
    el("div", { class: "charts", id: "charts" }, Object.entries(d.curves).map(([k, v]) => chart(k, d.labels[k] || k, v))));
};

pages.topology = async function () {
  const d = await api("/api/topology");
  main.replaceChildren(el("h1", {}, "Topology"),
    el("p", {}, `polar ${d.polar_version || "?"} · NATS ${d.nats_url} · Redis ${d.redis_url}`),
    section("Services", d.services.length ? table(["service", "url", "pid", "health"], d.services.map((s) => el("tr", { "data-service": s.name },
      el("td", {}, s.name), el("td", {}, s.url), el("td", {}, fmt(s.pid)), el("td", { class: s.ok ? "ok" : "error" }, s.ok ? "healthy" : `unhealthy (${s.status ?? "no answer"})`))), { id: "services-table" })
      : el("p", { class: "muted" }, "no stack record (the dashboard was not given the stack's state dir)")),
    section("Nodes", table(["node", "stages"], d.nodes.map((n) => el("tr", {}, el("td", {}, n.node),
      el("td", {}, Object.entries(n.stages).map(([k, v]) => `${k} ${v.used}/${v.bound ?? "–"}`).join(" · ")))))),
    section("Backends", table(["name", "kind", "url", "queue", "up"], d.backends.map((b) => el("tr", {}, el("td", {}, b.name), el("td", {}, b.kind || "–"), el("td", {}, b.url || "–"), el("td", {}, fmt(b.queue)), el("td", {}, b.up === null ? "–" : b.up ? "yes" : "NO"))))),
    section("Harnesses seen", el("p", {}, d.harnesses.join(", ") || "none yet")));
};

// Without the read token's cookie every page is this one (the server answers 401 with it)
function signIn(why) {
  document.title = "sign in · Polar dashboard";
  signedOut = true;
  unfollow();
  const live = document.getElementById("live");
  live.textContent = "signed out";
  live.className = "off";
  main.replaceChildren(el("h1", { id: "sign-in" }, "Sign in"),
    el("p", {}, "This dashboard shows the stack's sessions only to its operator. Open the URL ",
      el("code", {}, "polar dashboard"), " printed (run it on the stack's host: it prints a one-time sign-in link, good for 15 minutes; ",
      el("code", {}, "polar up"), " prints one too). The link signs this browser in for a day."),
    el("p", { class: "muted", id: "sign-in-why" }, why || ""));
}

pages.signin = async function () { signIn(body.dataset.why); };

pages.notfound = async function () {
  document.title = "not found · Polar dashboard";
  main.replaceChildren(el("h1", { id: "not-found" }, "Not found"), el("p", {}, `There is no ${body.dataset.what || "such page"} in this stack. `, link("/", "Back to the overview")));
};

// -- live updates ---------------------------------------------------------------------
const LIVE_PAGES = { overview: 1000, task: 1000, session: 3000, training: 1000 }; // least ms between re-renders
let rendering = false, again = false, lastRender = 0, signedOut = false;
let settled = false; // the page shows something final: live changes elsewhere leave it be

async function render() {
  if (rendering) { again = true; return; }
  rendering = true;
  try {
    await pages[PAGE]();
    lastRender = Date.now();
    body.dataset.rendered = String(lastRender);
  } catch (e) {
    if (e.status === 401) {
      signIn(e.message); // the sign-in expired, or the stack has new credentials
    } else if (e.status === 404) {
      main.replaceChildren(el("h1", { id: "not-found" }, "Not found"), el("p", {}, e.message));
    } else {
      main.replaceChildren(el("p", { class: "error" }, `could not load this page: ${e.message}`));
      again = true; // a slow or failed read is tried again, not left on screen until a change
    }
  } finally {
    rendering = false;
    if (again && !signedOut) { again = false; setTimeout(render, LIVE_PAGES[PAGE] || 1000); }
  }
}

let version = null, lastTrainerLog = null, lastMessage = 0, reconnects = 0;
let source = null, watchdog = null; // the open event stream and its watchdog

function unfollow() {
  clearInterval(watchdog);
  if (source) source.close();
  source = null;
}

function follow() {
  const live = document.getElementById("live");
  source = new EventSource("/api/live");
  lastMessage = Date.now();
  // the server speaks at least every 15 s: a stream closed or silent for longer is
  // reopened (an EventSource gives up for good after some failures)
  watchdog = setInterval(() => {
    if (source.readyState === EventSource.CLOSED || Date.now() - lastMessage > 35000) {
      unfollow();
      reconnects += 1;
      body.dataset.reconnects = String(reconnects);
      // a stream refused (401: signed out) closes for good: a render says which it was
      render().then(() => { if (!signedOut) follow(); });
    }
  }, 5000);
  source.addEventListener("change", (ev) => {
    lastMessage = Date.now();
    const d = JSON.parse(ev.data);
    banner(d.problems);
    live.textContent = `live · ${new Date(d.ts * 1000).toLocaleTimeString()}`;
    live.className = "on";
    body.dataset.liveVersion = String(d.version);
    const trainerLog = JSON.stringify(d.trainer_log);
    const changed = PAGE === "training" ? trainerLog !== lastTrainerLog && lastTrainerLog !== null
      : version !== null && d.version !== version;
    if (changed && PAGE in LIVE_PAGES && !settled) {
      const wait = LIVE_PAGES[PAGE] - (Date.now() - lastRender);
      setTimeout(render, Math.max(wait, 0));
    }
    version = d.version;
    lastTrainerLog = trainerLog;
  });
  source.onerror = () => { live.textContent = "live updates lost: reconnecting…"; live.className = "off"; };
}

render();
if (PAGE !== "notfound" && PAGE !== "signin") {
  follow();
  // A page left for another stays in the browser's back/forward cache: with its stream
  // open it would hold one of the six connections a browser gives a host, and after five
  // pages the next page's reads would wait (20 s, then "signal timed out"). Closed when
  // the page is left; opened again if it is shown again (its first message re-renders
  // the page if anything changed meanwhile).
  window.addEventListener("pagehide", unfollow);
  window.addEventListener("pageshow", (ev) => { if (ev.persisted && !source && !signedOut) follow(); });
}
