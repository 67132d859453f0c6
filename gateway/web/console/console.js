// chatflow console: plain JavaScript, no framework, no build step.
// Everything that comes from the API (titles, messages, errors) is attacker-controlled text from chat
// users: it is only ever put on the page with textContent, never parsed as HTML.
"use strict";

(() => {
  const TOKEN_KEY = "chatflow.adminToken";
  const PAGE_SIZE = 50;
  const HANDOFF_PREFIX = "transfer_to_";

  const $ = (id) => document.getElementById(id);
  const state = {
    sessions: [],
    nextCursor: null,
    query: "",
    selectedId: null,
    selected: null,
    listSeq: 0,
    openSeq: 0,
    inboxStatus: "dead",
    outboxStatus: "dead",
  };

  class AuthError extends Error {}

  // ---------- token and API ----------

  const getToken = () => sessionStorage.getItem(TOKEN_KEY);

  async function api(method, path, body) {
    const headers = { Authorization: `Bearer ${getToken() || ""}`, Accept: "application/json" };
    const init = { method, headers, cache: "no-store" };
    if (body !== undefined) {
      headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    const response = await fetch(path, init);
    if (response.status === 401) {
      sessionStorage.removeItem(TOKEN_KEY);
      showLogin("The token was not accepted. Enter it again.");
      throw new AuthError("unauthorized");
    }
    let data = null;
    if (response.status !== 204) {
      const text = await response.text();
      if (text) {
        try {
          data = JSON.parse(text);
        } catch (_) {
          data = { detail: text };
        }
      }
    }
    if (!response.ok) {
      const error = new Error(describeError(data, response.status));
      error.status = response.status;
      throw error;
    }
    return data;
  }

  function describeError(data, status) {
    if (data && typeof data.detail === "string") return data.detail;
    if (data && Array.isArray(data.detail) && data.detail.length && data.detail[0].msg) return data.detail[0].msg;
    if (data && typeof data.error === "string") return `${data.error} (${status})`;
    return `HTTP ${status}`;
  }

  const sessionPath = (id) => `/api/sessions/${encodeURIComponent(id)}`;

  // ---------- small DOM helpers ----------

  function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }

  let toastTimer = null;
  function toast(message) {
    const box = $("toast");
    box.textContent = message;
    box.hidden = false;
    clearTimeout(toastTimer);
    toastTimer = setTimeout(() => { box.hidden = true; }, 3000);
  }

  function fail(error) {
    if (error instanceof AuthError) return;
    toast(error.message || String(error));
  }

  const relative = new Intl.RelativeTimeFormat(undefined, { numeric: "auto", style: "short" });
  const absolute = new Intl.DateTimeFormat(undefined, { dateStyle: "medium", timeStyle: "short" });
  const clock = new Intl.DateTimeFormat(undefined, { hour: "2-digit", minute: "2-digit" });

  function parseTime(value) {
    const date = new Date(value);
    return Number.isNaN(date.getTime()) ? null : date;
  }

  function ago(value) {
    const date = parseTime(value);
    if (!date) return "";
    const seconds = Math.round((date.getTime() - Date.now()) / 1000);
    const abs = Math.abs(seconds);
    if (abs < 45) return "just now";
    if (abs < 3600) return relative.format(Math.round(seconds / 60), "minute");
    if (abs < 86400) return relative.format(Math.round(seconds / 3600), "hour");
    if (abs < 7 * 86400) return relative.format(Math.round(seconds / 86400), "day");
    return absolute.format(date);
  }

  const fullTime = (value) => {
    const date = parseTime(value);
    return date ? absolute.format(date) : "";
  };

  function platformBadge(platform) {
    const name = platform || "other";
    const badge = el("span", "badge", name);
    if (name === "telegram" || name === "whatsapp") badge.classList.add(name);
    return badge;
  }

  // ---------- login ----------

  function showLogin(message) {
    $("app").hidden = true;
    $("login").hidden = false;
    const error = $("login-error");
    error.textContent = message || "";
    error.hidden = !message;
    const input = $("token");
    input.value = "";
    input.focus();
  }

  async function signIn(event) {
    event.preventDefault();
    const token = $("token").value.trim();
    if (!token) return;
    sessionStorage.setItem(TOKEN_KEY, token);
    const button = event.target.querySelector("button");
    button.disabled = true;
    try {
      await api("GET", "/api/sessions?limit=1");
      start();
    } catch (error) {
      if (!(error instanceof AuthError)) showLogin(error.message);
    } finally {
      button.disabled = false;
    }
  }

  function signOut() {
    sessionStorage.removeItem(TOKEN_KEY);
    state.sessions = [];
    state.selectedId = null;
    state.selected = null;
    $("session-list").replaceChildren();
    showLogin("");
  }

  function start() {
    $("login").hidden = true;
    $("app").hidden = false;
    loadSessions(false);
    refreshStuckCount();
    refreshOutboxCount();
    route();
  }

  // ---------- routing (#/sessions, #/sessions/<id>, #/stuck, #/outbox, #/usage) ----------

  function route() {
    if ($("app").hidden) return;
    const hash = location.hash || "#/sessions";
    const views = { "#/stuck": "stuck", "#/outbox": "outbox", "#/usage": "usage" };
    const view = views[hash] || "sessions";
    for (const name of ["sessions", "stuck", "outbox", "usage"]) {
      $(`${name}-view`).hidden = name !== view;
      $(`tab-${name}`).classList.toggle("active", name === view);
    }
    if (view === "stuck") {
      loadInbox();
      return;
    }
    if (view === "outbox") {
      loadOutbox();
      return;
    }
    if (view === "usage") {
      loadUsage();
      return;
    }
    const prefix = "#/sessions/";
    if (hash.startsWith(prefix)) {
      let id = null;
      try {
        id = decodeURIComponent(hash.slice(prefix.length));
      } catch (_) {
        id = null;
      }
      if (id !== null) {
        openSession(id);
        return;
      }
    }
    closeSession();
  }

  const sessionHash = (id) => `#/sessions/${encodeURIComponent(id)}`;

  // ---------- the session list ----------

  async function loadSessions(append) {
    const seq = ++state.listSeq;
    const params = new URLSearchParams({ limit: String(PAGE_SIZE) });
    if (state.query) params.set("q", state.query);
    if (append && state.nextCursor) params.set("cursor", state.nextCursor);
    try {
      const data = await api("GET", `/api/sessions?${params}`);
      if (seq !== state.listSeq) return; // a newer search answered first
      const page = Array.isArray(data.sessions) ? data.sessions : [];
      state.sessions = append ? state.sessions.concat(page) : page;
      state.nextCursor = data.next_cursor || null;
      renderList();
    } catch (error) {
      fail(error);
    }
  }

  // As the server orders them: newest updated_at first, then session id (descending).
  function sortSessions() {
    const time = (s) => (parseTime(s.updated_at) || new Date(0)).getTime();
    state.sessions.sort((a, b) => time(b) - time(a) || (a.session_id < b.session_id ? 1 : a.session_id > b.session_id ? -1 : 0));
  }

  function renderList() {
    const list = $("session-list");
    list.replaceChildren(...state.sessions.map(sessionItem));
    $("list-empty").hidden = state.sessions.length > 0;
    $("list-empty").textContent = state.query ? "No session title matches." : "No sessions yet.";
    $("load-more").hidden = !state.nextCursor;
  }

  function sessionItem(session) {
    const li = el("li");
    const link = el("a", "session-item");
    link.href = sessionHash(session.session_id);
    link.dataset.sessionId = session.session_id;
    if (session.session_id === state.selectedId) {
      link.classList.add("active");
      link.setAttribute("aria-current", "true");
    }
    const row = el("div", "row");
    row.append(el("span", "title", session.title || "Untitled"));
    const time = el("time", "time", ago(session.updated_at));
    time.dateTime = session.updated_at || "";
    time.title = fullTime(session.updated_at);
    row.append(time);
    const sub = el("div", "sub");
    sub.append(platformBadge(session.platform));
    sub.append(el("span", "id mono", session.session_id));
    const count = Number(session.message_count) || 0;
    sub.append(el("span", "n", `${count} msg`));
    link.append(row, sub);
    li.append(link);
    return li;
  }

  function markActive() {
    for (const link of document.querySelectorAll(".session-item")) {
      const active = link.dataset.sessionId === state.selectedId;
      link.classList.toggle("active", active);
      if (active) link.setAttribute("aria-current", "true");
      else link.removeAttribute("aria-current");
    }
  }

  let searchTimer = null;
  function onSearch() {
    clearTimeout(searchTimer);
    searchTimer = setTimeout(() => {
      const query = $("search").value.trim();
      if (query === state.query) return;
      state.query = query;
      state.nextCursor = null;
      loadSessions(false);
    }, 200);
  }

  // ---------- the transcript ----------

  function closeSession() {
    state.selectedId = null;
    state.selected = null;
    state.openSeq++;
    $("sessions-view").classList.remove("reading");
    $("transcript-body").hidden = true;
    $("transcript-empty").hidden = false;
    markActive();
  }

  async function openSession(id) {
    const seq = ++state.openSeq;
    state.selectedId = id;
    markActive();
    $("sessions-view").classList.add("reading");
    try {
      const session = await api("GET", sessionPath(id));
      if (seq !== state.openSeq) return;
      state.selected = session;
      renderTranscript(session);
      loadSessionUsage(id, seq);
    } catch (error) {
      if (seq !== state.openSeq) return;
      if (error.status === 404) {
        toast("That session does not exist (any more).");
        location.hash = "#/sessions";
        return;
      }
      fail(error);
    }
  }

  function renderHeader(session) {
    $("session-title").textContent = session.title || "Untitled";
    $("session-title").hidden = false;
    $("title-input").hidden = true;
    $("title-error").hidden = true;
    $("session-platform").replaceWith(Object.assign(platformBadge(session.platform), { id: "session-platform" }));
    $("session-id").textContent = session.session_id;
    $("session-agent").textContent = session.active_agent ? `agent: ${session.active_agent}` : "";
    const count = Number(session.message_count) || (session.messages || []).length;
    const started = fullTime(session.created_at);
    $("session-count").textContent = `${count} messages${started ? ` · started ${started}` : ""}`;
  }

  function renderTranscript(session) {
    renderHeader(session);
    $("messages").replaceChildren(...transcriptNodes(session.messages || []));
    $("transcript-empty").hidden = true;
    $("transcript-body").hidden = false;
    $("transcript").scrollTop = 0;
  }

  // JSON on one line when it is short, indented when it is not; other text as it is.
  function jsonText(value) {
    const oneLine = JSON.stringify(value, null, 1).replace(/\n\s*/g, " ");
    return oneLine.length <= 72 ? oneLine : JSON.stringify(value, null, 2);
  }

  function pretty(text) {
    if (typeof text !== "string") return jsonText(text);
    try {
      const parsed = JSON.parse(text);
      if (parsed !== null && typeof parsed === "object") return jsonText(parsed);
    } catch (_) {
      // not JSON: shown as it is
    }
    return text;
  }

  function whoLine(label, kind, createdAt) {
    const who = el("div", "who");
    who.append(el("strong", null, label));
    if (kind) who.append(el("span", null, kind));
    const time = el("time", null, createdAt ? clock.format(parseTime(createdAt) || new Date()) : "");
    time.title = fullTime(createdAt);
    who.append(time);
    return who;
  }

  function handoffNode(target) {
    const node = el("li", "handoff", `→ handed off to ${target}`);
    node.dataset.target = target;
    return node;
  }

  // User, agent and tool messages look different; a handoff is a visible marker between agents.
  function transcriptNodes(messages) {
    const nodes = [];
    const callNames = new Map(); // tool_call_id -> tool name
    let currentAgent = null;

    const handoffTarget = (index, fromAgent, callName) => {
      for (let i = index + 1; i < messages.length; i++) {
        const next = messages[i];
        if (next.role === "model" && next.agent_name && next.agent_name !== fromAgent) return next.agent_name;
        if (next.role === "user") break;
      }
      return callName.slice(HANDOFF_PREFIX.length).replace(/_/g, " ");
    };

    messages.forEach((message, index) => {
      const role = message.role;
      const agent = message.agent_name || null;
      if (role === "user") {
        const li = el("li", "msg user");
        li.dataset.role = "user";
        li.append(whoLine("User", null, message.created_at), el("div", "bubble", message.content || ""));
        nodes.push(li);
        return;
      }
      if (role === "model") {
        if (agent && currentAgent && agent !== currentAgent) nodes.push(handoffNode(agent));
        if (agent) currentAgent = agent;
        if (message.content) {
          const li = el("li", "msg agent");
          li.dataset.role = "agent";
          li.append(whoLine(agent || "Agent", null, message.created_at), el("div", "bubble", message.content));
          nodes.push(li);
        }
        for (const call of message.tool_calls || []) {
          callNames.set(call.id, call.name);
          if (String(call.name).startsWith(HANDOFF_PREFIX)) continue; // shown as the handoff marker
          const li = el("li", "tool call");
          li.dataset.role = "tool-call";
          const head = el("div", "tool-head");
          head.append(el("span", "tool-kind", "tool call"), el("span", "tool-name", call.name));
          if (agent) head.append(el("span", null, `by ${agent}`));
          li.append(head, el("pre", null, jsonText(call.arguments || {})));
          nodes.push(li);
        }
        return;
      }
      if (role === "tool") {
        const name = callNames.get(message.tool_call_id) || message.name || "tool";
        if (String(name).startsWith(HANDOFF_PREFIX)) {
          const target = handoffTarget(index, agent || currentAgent, name);
          nodes.push(handoffNode(target));
          currentAgent = target;
          return;
        }
        const li = el("li", "tool result");
        li.dataset.role = "tool-result";
        const head = el("div", "tool-head");
        head.append(el("span", "tool-kind", "tool result"), el("span", "tool-name", name));
        li.append(head, el("pre", null, pretty(message.content || "")));
        nodes.push(li);
        return;
      }
      const li = el("li", "msg system");
      li.dataset.role = role || "system";
      li.append(el("div", "bubble", message.content || ""));
      nodes.push(li);
    });
    if (!nodes.length) nodes.push(el("li", "empty", "No messages yet."));
    return nodes;
  }

  // ---------- rename (double-click the title) ----------

  let renaming = false;

  function beginRename() {
    if (!state.selected) return;
    const input = $("title-input");
    input.value = state.selected.title || "";
    $("session-title").hidden = true;
    $("title-error").hidden = true;
    input.hidden = false;
    input.focus();
    input.select();
  }

  function endRename() {
    $("title-input").hidden = true;
    $("session-title").hidden = false;
  }

  async function commitRename() {
    if (renaming || $("title-input").hidden || !state.selected) return;
    const session = state.selected;
    const title = $("title-input").value.trim();
    if (title === (session.title || "")) {
      endRename();
      return;
    }
    if (!title || title.length > 200) {
      showTitleError("A title is 1 to 200 characters.");
      return;
    }
    renaming = true;
    try {
      const updated = await api("PUT", sessionPath(session.session_id), { title });
      const newTitle = updated && typeof updated.title === "string" ? updated.title : title;
      session.title = newTitle;
      $("session-title").textContent = newTitle;
      endRename();
      const listed = state.sessions.find((s) => s.session_id === session.session_id);
      if (listed) {
        listed.title = newTitle;
        if (updated && updated.updated_at) listed.updated_at = updated.updated_at;
        sortSessions();
      }
      renderList();
      toast("Renamed.");
    } catch (error) {
      if (error.status === 422) showTitleError(error.message);
      else fail(error);
    } finally {
      renaming = false;
    }
  }

  function showTitleError(message) {
    const box = $("title-error");
    box.textContent = message;
    box.hidden = false;
    $("title-input").focus();
  }

  function onTitleKey(event) {
    if (event.key === "Enter") {
      event.preventDefault();
      commitRename();
    } else if (event.key === "Escape") {
      event.preventDefault();
      $("title-error").hidden = true;
      endRename();
    }
  }

  // ---------- delete, with confirmation ----------

  function askDelete() {
    const session = state.selected;
    if (!session) return;
    const count = Number(session.message_count) || (session.messages || []).length;
    $("confirm-text").textContent =
      `“${session.title || session.session_id}” and its ${count} messages will be deleted for good.`;
    const dialog = $("confirm-delete");
    dialog.returnValue = "";
    dialog.showModal();
    $("confirm-cancel").focus();
  }

  async function onDeleteClosed() {
    const session = state.selected;
    if ($("confirm-delete").returnValue !== "delete" || !session) return;
    try {
      await api("DELETE", sessionPath(session.session_id));
      state.sessions = state.sessions.filter((s) => s.session_id !== session.session_id);
      renderList();
      toast("Session deleted.");
      location.hash = "#/sessions";
    } catch (error) {
      fail(error);
    }
  }

  // ---------- stuck messages ----------

  const inboxRows = (data) => (data && Array.isArray(data.items) ? data.items : []);

  async function refreshStuckCount() {
    try {
      const rows = inboxRows(await api("GET", "/api/inbox?status=dead"));
      const badge = $("stuck-count");
      badge.textContent = String(rows.length);
      badge.hidden = rows.length === 0;
    } catch (error) {
      fail(error);
    }
  }

  let inboxSeq = 0;
  async function loadInbox() {
    const seq = ++inboxSeq;
    for (const button of document.querySelectorAll("#stuck-view .seg")) {
      button.classList.toggle("active", button.dataset.status === state.inboxStatus);
    }
    try {
      const rows = inboxRows(await api("GET", `/api/inbox?status=${encodeURIComponent(state.inboxStatus)}`));
      if (seq !== inboxSeq) return;
      $("inbox-list").replaceChildren(...rows.map(inboxItem));
      $("inbox-empty").hidden = rows.length > 0;
      if (state.inboxStatus === "dead") {
        $("stuck-count").textContent = String(rows.length);
        $("stuck-count").hidden = rows.length === 0;
      }
    } catch (error) {
      fail(error);
    }
  }

  function inboxItem(row) {
    const li = el("li", "inbox-item");
    li.dataset.inboxId = String(row.id);
    const head = el("div", "head");
    head.append(el("strong", null, `#${row.id}`), platformBadge(row.platform));
    const link = el("a", "mono", row.session_id);
    link.href = sessionHash(row.session_id);
    head.append(link);
    head.append(el("span", null, row.kind || ""));
    head.append(el("span", null, `${Number(row.attempts) || 0} attempts`));
    const time = el("time", null, ago(row.received_at));
    time.title = fullTime(row.received_at);
    head.append(time);
    li.append(head);
    if (row.status === "dead") {
      const button = el("button", "retry", "Retry");
      button.type = "button";
      button.addEventListener("click", () => retry(row, button, li));
      li.append(button);
    } else {
      li.append(el("span", "badge", row.status || ""));
    }
    li.append(el("div", "text", row.text || "(no text)"));
    if (row.last_error) li.append(el("pre", "last-error", row.last_error));
    return li;
  }

  async function retry(row, button, li) {
    button.disabled = true;
    try {
      await api("POST", `/api/inbox/${encodeURIComponent(row.id)}/retry`);
      li.remove();
      $("inbox-empty").hidden = $("inbox-list").children.length > 0;
      toast(`Message #${row.id} is queued again.`);
      refreshStuckCount();
    } catch (error) {
      button.disabled = false;
      fail(error);
    }
  }

  // ---------- undelivered replies (the outbox's dead and failed rows) ----------

  const COUNT_LIMIT = 100;

  function showOutboxCount(count) {
    const badge = $("outbox-count");
    badge.textContent = count >= COUNT_LIMIT ? `${COUNT_LIMIT - 1}+` : String(count);
    badge.hidden = count === 0;
  }

  // Only dead replies are counted: failed ones (a user who blocked the bot) are routine.
  async function refreshOutboxCount() {
    try {
      showOutboxCount(inboxRows(await api("GET", `/api/outbox?status=dead&limit=${COUNT_LIMIT}`)).length);
    } catch (error) {
      fail(error);
    }
  }

  let outboxSeq = 0;
  async function loadOutbox() {
    const seq = ++outboxSeq;
    const status = state.outboxStatus;
    for (const button of document.querySelectorAll("#outbox-view .seg")) {
      button.classList.toggle("active", button.dataset.status === status);
    }
    try {
      const rows = inboxRows(await api("GET", `/api/outbox?status=${encodeURIComponent(status)}`));
      if (seq !== outboxSeq) return;
      $("outbox-list").replaceChildren(...rows.map(outboxItem));
      $("outbox-empty").textContent = status === "dead" ? "No dead replies." : "No failed replies.";
      $("outbox-empty").hidden = rows.length > 0;
      if (status === "dead") showOutboxCount(rows.length);
    } catch (error) {
      fail(error);
    }
  }

  function outboxItem(row) {
    const li = el("li", "inbox-item outbox-item");
    li.dataset.outboxId = String(row.id);
    const head = el("div", "head");
    head.append(el("strong", null, `#${row.id}`), platformBadge(row.platform));
    const link = el("a", "mono", row.session_id);
    link.href = sessionHash(row.session_id);
    link.title = "Open the transcript";
    head.append(link);
    head.append(el("span", null, row.kind || ""));
    const attempts = Number(row.attempts) || 0;
    head.append(el("span", "attempts", `${attempts} attempt${attempts === 1 ? "" : "s"}`));
    const time = el("time", null, ago(row.created_at));
    time.dateTime = row.created_at || "";
    time.title = `queued ${fullTime(row.created_at)} · last change ${fullTime(row.updated_at)}`;
    head.append(time);
    li.append(head);
    if (row.status === "dead" || row.status === "failed") {
      const button = el("button", "retry", "Retry");
      button.type = "button";
      button.addEventListener("click", () => retryReply(row, button, li));
      li.append(button);
    } else {
      li.append(el("span", "badge status", row.status || ""));
    }
    const error = [row.error_code, row.error_message].filter(Boolean).join(": ");
    if (error) li.append(el("pre", "last-error", error));
    return li;
  }

  // The row stays, showing what the server says it is now (pending), until the view is reloaded.
  async function retryReply(row, button, li) {
    button.disabled = true;
    try {
      const updated = await api("POST", `/api/outbox/${encodeURIComponent(row.id)}/retry`);
      li.replaceWith(outboxItem(updated && updated.id === row.id ? updated : { ...row, status: "pending" }));
      toast(`Reply #${row.id} is queued again.`);
      refreshOutboxCount();
    } catch (error) {
      button.disabled = false;
      fail(error);
      if (error.status === 404 || error.status === 409) loadOutbox(); // someone else changed it
    }
  }

  // ---------- model usage ----------

  const number = (value) => (Number(value) || 0).toLocaleString("en-US");
  const dollars = (value) => (value === null || value === undefined ? "n/a" : `$${Number(value).toFixed(4)}`);

  function usageSummary(models) {
    if (!models.length) return "";
    const sum = (key) => models.reduce((total, m) => total + (Number(m[key]) || 0), 0);
    const priced = models.every((m) => m.estimated_cost_usd !== null && m.estimated_cost_usd !== undefined);
    const cost = priced ? ` · ${dollars(sum("estimated_cost_usd"))}` : "";
    return `${number(sum("input_tokens"))} tokens in · ${number(sum("output_tokens"))} out · ${number(sum("calls"))} model calls${cost}`;
  }

  async function loadSessionUsage(id, seq) {
    $("session-usage").textContent = "";
    try {
      const data = await api("GET", `/api/usage/sessions/${encodeURIComponent(id)}`);
      if (seq !== state.openSeq) return;
      const models = (data && Array.isArray(data.models)) ? data.models : [];
      $("session-usage").textContent = usageSummary(models);
      $("session-usage").title = models.map((m) => `${m.model}: ${number(m.turns)} turns`).join("\n");
    } catch (error) {
      fail(error);
    }
  }

  let usageSeq = 0;
  async function loadUsage() {
    const seq = ++usageSeq;
    try {
      const data = await api("GET", "/api/usage?days=30");
      if (seq !== usageSeq) return;
      const rows = (data && Array.isArray(data.items)) ? data.items : [];
      $("usage-rows").replaceChildren(...rows.map(usageRow));
      $("usage-table").hidden = rows.length === 0;
      $("usage-empty").hidden = rows.length > 0;
    } catch (error) {
      fail(error);
    }
  }

  function usageRow(row) {
    const tr = el("tr");
    const seconds = (Number(row.latency_ms) || 0) / 1000;
    for (const text of [
      row.day || "", row.model || "", number(row.turns), number(row.calls), number(row.input_tokens),
      number(row.output_tokens), number(row.tool_calls), `${seconds.toFixed(1)} s`, dollars(row.estimated_cost_usd),
    ]) {
      tr.append(el("td", null, text));
    }
    return tr;
  }

  // ---------- wiring ----------

  function init() {
    $("login-form").addEventListener("submit", signIn);
    $("sign-out").addEventListener("click", signOut);
    $("search").addEventListener("input", onSearch);
    $("load-more").addEventListener("click", () => loadSessions(true));
    $("session-title").addEventListener("dblclick", beginRename);
    $("title-input").addEventListener("keydown", onTitleKey);
    $("title-input").addEventListener("blur", () => { if (!$("title-input").hidden) commitRename(); });
    $("delete").addEventListener("click", askDelete);
    $("confirm-delete").addEventListener("close", onDeleteClosed);
    for (const button of document.querySelectorAll("#stuck-view .seg")) {
      button.addEventListener("click", () => {
        state.inboxStatus = button.dataset.status;
        loadInbox();
      });
    }
    for (const button of document.querySelectorAll("#outbox-view .seg")) {
      button.addEventListener("click", () => {
        state.outboxStatus = button.dataset.status;
        loadOutbox();
      });
    }
    window.addEventListener("hashchange", route);
    if (getToken()) start();
    else showLogin("");
  }

  init();
})();
