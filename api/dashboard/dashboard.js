// lockledger dashboard: reads the public API (docs/dashboard.md) and draws the fleet, live or at a past
// instant. Plain ES module, no framework, no build step. Every request carries the dashboard token from
// sessionStorage when there is one; a 401 shows the token form (in dev mode none is asked for).
//
// Data: /v1/locks (held locks, re-polled every few seconds), /v1/events/stream (the change feed: tables
// update on each event), /v1/sagas (in flight and stuck), /v1/stats (conflicts/s from this server's
// counters), /v1/stats/agents (each agent's holds, mean hold and lapses, from the agent_stats projector),
// /v1/replay/state and /v1/replay/changes (the time slider), /v1/locks/{resource} (a lock's detail: its
// fair queue in order). Each held lock shows the reservation it was taken in (a badge: clicking it shows
// that reservation's locks alone) and how many acquires wait for it (`queued`). Times come from the
// server's clock: the offset to it is measured on each /v1/locks answer (its `at`).

import { setUpTimeline } from "./timeline.js";

const TOKEN_KEY = "lockledger.token";
const LOCK_POLL_MS = 3000;
const SAGA_POLL_MS = 5000;
const STATS_POLL_MS = 2000;
const EXPIRING_MS = 10_000;
const AROUND_MS = 30_000; // events shown around a scrubbed instant, each side (narrowed on a busy fleet)
const MIN_AROUND_MS = 100;
const HALF_PAGE = 500; // events shown each side of it, at most
const SLIDER_SPAN_MS = 3600_000;
const MAX_EVENTS = 150;

const $ = (id) => document.getElementById(id);

const state = {
  locks: new Map(), // resource -> {version, seenAt (ms, server clock), lock | null (null: freed)}
  offsetMs: 0, // server clock minus this browser's
  events: [], // newest first, from the feed
  sagas: { inFlight: [], stuck: [] },
  scrub: null, // {at: ms, locks: [...], changes: [...]} while viewing the past
  grants: new Map(), // second -> LOCK_ACQUIRED events seen
  expiries: new Map(), // minute -> LOCK_EXPIRED events seen
  conflicts: [], // {at, rate} from two /v1/stats reads of one process
  lastStats: null,
  agentStats: new Map(), // owner -> {holds, ended, mean_hold_ms, lapses} from /v1/stats/agents
  reservation: null, // the reservation id the held table is narrowed to, if any
  detail: null, // {resource, lock: the /v1/locks/{resource} answer | null} while a lock's detail is open
  tokenWaiters: [],
};

const serverNow = () => Date.now() + state.offsetMs;

// ---- HTTP ---------------------------------------------------------------------------------------------

class NeedToken extends Error {}

function authHeaders() {
  const token = sessionStorage.getItem(TOKEN_KEY);
  return token ? { Authorization: `Bearer ${token}` } : {};
}

async function api(path) {
  const response = await fetch(path, { headers: { Accept: "application/json", ...authHeaders() } });
  if (response.status === 401) {
    askForToken(sessionStorage.getItem(TOKEN_KEY) ? "This token is unknown or revoked." : "");
    throw new NeedToken();
  }
  if (response.status === 403) {
    askForToken("This token's role may not read the lock state: use a dashboard token.");
    throw new NeedToken();
  }
  if (!response.ok) throw new Error(`${path}: HTTP ${response.status}`);
  return response.json();
}

function tokenReady() {
  if ($("token-overlay").hidden) return Promise.resolve();
  return new Promise((resolve) => state.tokenWaiters.push(resolve));
}

function askForToken(message) {
  if (message || $("token-overlay").hidden) $("token-error").textContent = message;
  $("token-overlay").hidden = false;
  $("token").focus();
}

function acceptToken(event) {
  event.preventDefault();
  sessionStorage.setItem(TOKEN_KEY, $("token").value.trim());
  $("token").value = "";
  $("token-overlay").hidden = true;
  $("forget-token").hidden = false;
  for (const resolve of state.tokenWaiters.splice(0)) resolve();
  refreshAll();
}

// ---- the change feed: fetch() + ReadableStream, as EventSource cannot send Authorization ----------------

// Parses server-sent events (id:, event:, data: lines; a blank line ends a message; ':' starts a comment)
// from text chunks, calling onMessage({id, event, data}) per message.
function sseParser(onMessage) {
  let buffer = "";
  return (chunk) => {
    buffer += chunk.replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const message = { id: null, event: "message", data: [] };
      for (const line of block.split("\n")) {
        if (!line || line.startsWith(":")) continue;
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        const value = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
        if (field === "id") message.id = value;
        else if (field === "event") message.event = value;
        else if (field === "data") message.data.push(value);
      }
      if (message.data.length) onMessage({ ...message, data: message.data.join("\n") });
    }
  };
}

// Follows /v1/events/stream for ever: after a drop (or an overflow) it reconnects with Last-Event-ID, so
// no event is missed, and re-reads the locks.
async function followFeed() {
  let lastId = null;
  let backoffMs = 500;
  for (;;) {
    await tokenReady();
    try {
      const headers = { Accept: "text/event-stream", ...authHeaders() };
      if (lastId) headers["Last-Event-ID"] = lastId;
      const response = await fetch("/v1/events/stream", { headers });
      if (response.status === 401 || response.status === 403) {
        askForToken(response.status === 403 ? "This token's role may not follow the feed." : "");
        continue;
      }
      if (!response.ok || !response.body) throw new Error(`feed: HTTP ${response.status}`);
      setFeedStatus("live");
      backoffMs = 500;
      if (lastId) pollLocks().catch(() => {});
      const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
      const feed = sseParser((message) => {
        if (message.id) lastId = message.id;
        if (message.event !== "overflow") onEvent(JSON.parse(message.data));
      });
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        feed(value);
      }
    } catch (error) {
      if (!(error instanceof TypeError)) console.warn("feed:", error);
    }
    setFeedStatus("reconnecting");
    await sleep(backoffMs);
    backoffMs = Math.min(backoffMs * 2, 10_000);
  }
}

const LOCK_ENDS = new Set(["LOCK_RELEASED", "LOCK_EXPIRED", "LOCK_FORCE_RELEASED"]);

function onEvent(event) {
  const at = Date.parse(event.recorded_at);
  state.events.unshift(event);
  state.events.length = Math.min(state.events.length, MAX_EVENTS);
  if (event.type === "LOCK_ACQUIRED") bump(state.grants, Math.floor(at / 1000));
  if (event.type === "LOCK_EXPIRED") bump(state.expiries, Math.floor(at / 60_000));
  if (event.type === "LOCK_ACQUIRED" || event.type === "LOCK_RENEWED" || event.type === "LOCK_HANDED_OFF") {
    const data = event.data;
    const meta = event.metadata || {};
    // A hand-off begins the receiver's lease: the giver's saga and reservation are not the receiver's.
    const known = state.locks.get(event.stream)?.lock;
    const before = event.type === "LOCK_HANDED_OFF" ? null : known;
    remember(event.stream, event.version, at, {
      resource: event.stream,
      owner: data.owner,
      fencing_token: data.fencing_token,
      expires_at: data.expires_at,
      ttl_ms: data.ttl_ms,
      saga_id: meta.saga_id ?? before?.saga_id ?? null,
      saga_step: meta.saga_step ?? before?.saga_step ?? null,
      // A grant names its reservation; a renewal keeps the lease's (an acquire outside one names none).
      reservation_id: event.type === "LOCK_RENEWED" ? before?.reservation_id ?? null : meta.reservation_id ?? null,
      queued: known?.queued ?? 0, // the queue is not in the feed: the next poll of /v1/locks counts it
    });
  } else if (LOCK_ENDS.has(event.type)) {
    remember(event.stream, event.version, at, null);
  } else if (!event.type.startsWith("LOCK_")) {
    soon(pollSagas, 200); // a saga moved
  }
  if (state.detail?.resource === event.stream) soon(pollDetail, 200);
  render();
}

function remember(resource, version, seenAt, lock) {
  const known = state.locks.get(resource);
  if (known && known.version > version) return; // an older state than the one shown
  state.locks.set(resource, { version, seenAt, lock });
}

// ---- polls ---------------------------------------------------------------------------------------------

async function pollLocks() {
  const sent = Date.now();
  const page = await api("/v1/locks?limit=1000");
  const at = Date.parse(page.at);
  state.offsetMs = at - (sent + Date.now()) / 2;
  const listed = new Set();
  for (const lock of page.items) {
    listed.add(lock.resource);
    remember(lock.resource, lock.version, Date.parse(lock.updated_at), lock);
  }
  for (const [resource, known] of state.locks) {
    // Not listed: free as of `at`, unless the feed told of something newer.
    if (!listed.has(resource) && known.seenAt <= at) state.locks.delete(resource);
  }
  $("held-note").textContent = page.next_cursor ? "(the first 1,000)" : "";
  if (state.detail) await pollDetail();
  render();
}

// A lock's detail: its state and its fair queue, first in line first (GET /v1/locks/{resource}).
async function pollDetail() {
  const resource = state.detail?.resource;
  if (!resource) return;
  const lock = await api(`/v1/locks/${encodeURIComponent(resource)}`);
  if (state.detail?.resource !== resource) return; // closed or moved on meanwhile
  state.detail.lock = lock;
  renderDetail();
}

function openDetail(resource) {
  state.detail = { resource, lock: null };
  renderDetail();
  pollDetail().catch((error) => {
    if (!(error instanceof NeedToken)) console.warn(error);
  });
}

function closeDetail() {
  state.detail = null;
  renderDetail();
}

function showReservation(id) {
  state.reservation = id;
  renderLocks();
}

async function pollSagas() {
  const [running, compensating, stuck] = await Promise.all(
    ["running", "compensating", "stuck"].map((status) => api(`/v1/sagas?status=${status}&limit=200`)),
  );
  state.sagas.inFlight = [...running.items, ...compensating.items];
  state.sagas.stuck = stuck.items;
  render();
}

async function pollStats() {
  const stats = await api("/v1/stats");
  const previous = state.lastStats;
  state.lastStats = stats;
  if (!previous || previous.process.id !== stats.process.id) return; // a restart or another worker
  const seconds = (Date.parse(stats.at) - Date.parse(previous.at)) / 1000;
  const refused = (s) => Object.values(s.commands).reduce((sum, by) => sum + (by.lock_held || 0), 0);
  if (seconds <= 0) return;
  state.conflicts.push({ at: Date.parse(stats.at), rate: (refused(stats) - refused(previous)) / seconds });
  state.conflicts.splice(0, Math.max(0, state.conflicts.length - 60));
}

async function pollAgentStats() {
  const page = await api("/v1/stats/agents?limit=1000");
  state.agentStats = new Map(page.items.map((item) => [item.owner, item]));
}

function agentFigures(owner) {
  const figures = state.agentStats.get(owner);
  if (!figures) return "";
  const mean = figures.mean_hold_ms === null ? "–" : `${(figures.mean_hold_ms / 1000).toFixed(1)} s`;
  return `${figures.holds} holds · mean ${mean} · ${figures.lapses} lapses`;
}

function every(ms, poll) {
  const run = async () => {
    try {
      await poll();
    } catch (error) {
      if (!(error instanceof NeedToken)) console.warn(error);
    }
    setTimeout(run, ms);
  };
  run();
}

function refreshAll() {
  for (const poll of [pollLocks, pollSagas, pollStats, pollAgentStats]) poll().catch(() => {});
  if (state.scrub) scrubTo(state.scrub.at);
}

// ---- the time slider -----------------------------------------------------------------------------------

async function scrubTo(at) {
  at = Math.min(at, serverNow() - 1000);
  state.scrub = { ...(state.scrub ?? { locks: [], changes: [], before: AROUND_MS, after: AROUND_MS, cut: false }), at, ready: false };
  const instant = new Date(at).toISOString();
  history.replaceState(null, "", `?at=${encodeURIComponent(instant)}`);
  render();
  try {
    const [fleet, near] = await Promise.all([
      api(`/v1/replay/state?at=${encodeURIComponent(instant)}&limit=10000`),
      changesAround(at),
    ]);
    if (state.scrub?.at !== at) return; // moved on meanwhile
    // The mutex leases, as the live view shows them (a shared lock's grants have a mode).
    state.scrub = { at, locks: fleet.locks.filter((lock) => lock.mode == null), ...near, ready: true };
  } catch (error) {
    if (!(error instanceof NeedToken)) console.warn(error);
  }
  render();
}

// The events nearest an instant, at most a page (500) each side. After it: the first page of the 30 s
// after. Before it, where the API pages forwards only: the widest window up to 30 s whose events fit a page
// (bisected, to 100 ms), so a busy fleet shows the events just before the instant, not the first of the
// 30 s. `cut` says even 100 ms before it held more than a page.
async function changesAround(at) {
  const [[before, beforeMs, cut], after] = await Promise.all([
    nearestBefore(at),
    changesBetween(at, at + AROUND_MS),
  ]);
  return {
    changes: [...before.changes, ...after.changes],
    before: beforeMs,
    after: after.next_cursor ? Date.parse(after.changes.at(-1).at) - at : AROUND_MS,
    cut,
  };
}

async function nearestBefore(at) {
  const whole = await changesBetween(at - AROUND_MS, at);
  if (!whole.next_cursor) return [whole, AROUND_MS, false];
  let [fits, wide, best] = [0, AROUND_MS, null];
  while (wide - fits > MIN_AROUND_MS) {
    const tried = (fits + wide) / 2;
    const page = await changesBetween(at - tried, at);
    if (page.next_cursor) wide = tried;
    else [fits, best] = [tried, page];
  }
  if (best) return [best, fits, false];
  const narrowest = await changesBetween(at - MIN_AROUND_MS, at);
  return [narrowest, MIN_AROUND_MS, Boolean(narrowest.next_cursor)];
}

function changesBetween(from, to) {
  const iso = (ms) => encodeURIComponent(new Date(ms).toISOString());
  to = Math.min(to, serverNow() - 1000);
  return api(`/v1/replay/changes?from=${iso(from)}&to=${iso(to)}&limit=${HALF_PAGE}`);
}

function goLive() {
  state.scrub = null;
  history.replaceState(null, "", location.pathname);
  render();
}

let sliderTimer = null;
function onSlide() {
  const value = Number($("slider").value);
  clearTimeout(sliderTimer);
  if (value >= Number($("slider").max)) return goLive();
  sliderTimer = setTimeout(() => scrubTo(value), 120);
  $("slider-label").textContent = formatInstant(value);
}

function placeSlider() {
  const slider = $("slider");
  const now = Math.floor(serverNow() / 1000) * 1000;
  const oldest = state.scrub ? Math.min(state.scrub.at, now - SLIDER_SPAN_MS) : now - SLIDER_SPAN_MS;
  slider.min = String(Math.floor(oldest / 1000) * 1000);
  slider.max = String(now);
  if (document.activeElement !== slider || !state.scrub) slider.value = String(state.scrub ? state.scrub.at : now);
}

// ---- rendering -----------------------------------------------------------------------------------------

function shownLocks() {
  if (state.scrub) {
    return state.scrub.locks.map((lock) => ({ ...lock, left: Date.parse(lock.expires_at) - state.scrub.at }));
  }
  const now = serverNow();
  const locks = [];
  for (const { lock } of state.locks.values()) {
    if (!lock) continue;
    const left = Date.parse(lock.expires_at) - now;
    if (left > 0) locks.push({ ...lock, left });
  }
  return locks.sort((a, b) => (a.resource < b.resource ? -1 : 1));
}

// Everything, after new data; the clock's tick redraws only what time changes (renderLocks, charts).
function render() {
  renderLocks();
  renderSagas();
  renderEvents();
  renderCharts();
  renderMode();
  $("count-sagas").textContent = state.sagas.inFlight.length;
  $("count-stuck").textContent = state.sagas.stuck.length;
}

function renderLocks() {
  const locks = shownLocks();
  renderHeld(locks);
  renderExpiring(locks);
  renderAgents(locks);
  $("count-held").textContent = locks.length;
  $("count-reservations").textContent = new Set(locks.map((lock) => lock.reservation_id).filter(Boolean)).size;
}

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = value;
    else node.setAttribute(key, value);
  }
  node.append(...children);
  return node;
}

// Rows of the held table by resource, kept across redraws: a redraw changes only the cells whose text
// changed, so a selection (copying a resource name) survives the clock's tick.
const heldRows = new Map();

function heldRow(resource) {
  const cells = {
    owner: el("td"),
    token: el("td", { class: "mono" }),
    fill: el("div", { class: "fill" }),
    secs: el("span", { class: "secs" }),
    saga: el("td"),
    badge: el("button", { type: "button", class: "badge", hidden: "" }),
    queued: el("td", { class: "queued" }),
  };
  cells.bar = el("div", { class: "time-left" }, el("div", { class: "track" }, cells.fill), cells.secs);
  const name = el("td", { class: "mono resource", text: resource, title: `${resource}: click for its queue` });
  name.addEventListener("click", () => openDetail(resource));
  cells.badge.addEventListener("click", () => showReservation(cells.badge.dataset.reservation));
  cells.tr = el(
    "tr",
    { "data-resource": resource },
    name,
    cells.owner,
    cells.token,
    el("td", { class: "left" }, cells.bar),
    cells.saga,
    el("td", { class: "reservation" }, cells.badge),
    cells.queued,
  );
  return cells;
}

// A reservation's hue, the same for every lock of it and on every redraw: its locks read as one group.
function hueOf(id) {
  let hash = 0;
  for (const char of id) hash = (hash * 31 + char.codePointAt(0)) >>> 0;
  return hash % 360;
}

function setReservation(row, id) {
  if (row.badge.dataset.reservation === (id ?? "")) return;
  row.badge.dataset.reservation = id ?? "";
  row.tr.dataset.reservation = id ?? "";
  row.badge.textContent = id ?? "";
  row.badge.title = id ? `Reservation ${id}: show its locks alone` : "";
  row.badge.hidden = !id;
  if (id) row.badge.style.setProperty("--hue", String(hueOf(id)));
}

// The queue's length, from the live list; the past's queues are not recorded (empty while scrubbed).
function setQueued(row, queued) {
  const known = typeof queued === "number";
  setText(row.queued, known && queued > 0 ? String(queued) : "");
  row.queued.dataset.queued = known ? String(queued) : "";
  row.queued.title = known ? `${queued} acquire(s) waiting` : "not known for the past";
}

function setText(node, text) {
  if (node.textContent !== text) node.textContent = text;
}

function renderHeld(all) {
  const body = $("held").tBodies[0];
  const only = state.reservation;
  const locks = only ? all.filter((lock) => lock.reservation_id === only) : all;
  $("held-filter").hidden = !only;
  if (only) {
    setText($("held-filter-id"), only);
    setText($("held-filter-count"), `${locks.length} lock(s)`);
  }
  const rows = locks.map((lock) => {
    let row = heldRows.get(lock.resource);
    if (!row) heldRows.set(lock.resource, (row = heldRow(lock.resource)));
    setText(row.owner, lock.owner);
    setText(row.token, String(lock.fencing_token));
    setText(row.saga, lock.saga_id ? `${lock.saga_id} · ${lock.saga_step ?? ""}` : "");
    row.saga.title = row.saga.textContent;
    setReservation(row, lock.reservation_id);
    setQueued(row, lock.queued);
    row.owner.title = lock.owner;
    const ttl = lock.ttl_ms || Date.parse(lock.expires_at) - Date.parse(lock.acquired_at) || lock.left;
    row.fill.style.width = `${Math.max(0, Math.min(100, (100 * lock.left) / ttl))}%`;
    setText(row.secs, `${(lock.left / 1000).toFixed(1)} s`);
    row.bar.toggleAttribute("data-soon", lock.left < EXPIRING_MS);
    return row.tr;
  });
  const shown = new Set(locks.map((lock) => lock.resource));
  for (const resource of heldRows.keys()) if (!shown.has(resource)) heldRows.delete(resource);
  if (rows.length !== body.children.length || rows.some((tr, i) => body.children[i] !== tr)) {
    body.replaceChildren(...rows);
  }
  $("held-empty").hidden = locks.length > 0;
  $("held-empty").textContent = only
    ? "No lock of this reservation is held."
    : state.scrub
      ? "No lock was held then."
      : "No lock is held.";
}

function renderDetail() {
  const detail = state.detail;
  $("detail-card").hidden = !detail;
  if (!detail) return;
  $("detail-card").dataset.resource = detail.resource;
  setText($("detail-resource"), detail.resource);
  const lock = detail.lock;
  const facts = lock
    ? [
        ["Status", lock.status],
        ["Holder", lock.status === "held" ? lock.owner : ""],
        ["Token", String(lock.fencing_token)],
        ["Reservation", lock.reservation_id ?? ""],
        ["Saga", lock.saga_id ? `${lock.saga_id} · ${lock.saga_step ?? ""}` : ""],
      ]
    : [["Status", "loading…"]];
  $("detail-facts").replaceChildren(
    ...facts.filter(([, value]) => value).flatMap(([term, value]) => [el("dt", { text: term }), el("dd", { text: value })]),
  );
  const queue = lock?.queue ?? [];
  $("detail-queue").replaceChildren(
    ...queue.map((waiting, place) =>
      el(
        "li",
        { "data-owner": waiting.owner, "data-place": String(place + 1) },
        el("span", { text: `${place + 1}. ${waiting.owner}` }),
        el("span", { class: "why", text: `waits until ${formatClock(Date.parse(waiting.deadline))}` }),
      ),
    ),
  );
  $("detail-queue-empty").hidden = queue.length > 0;
}

function renderExpiring(locks) {
  const soon = locks.filter((lock) => lock.left < EXPIRING_MS).sort((a, b) => a.left - b.left);
  $("expiring").replaceChildren(
    ...soon.slice(0, 50).map((lock) =>
      el(
        "li",
        { "data-resource": lock.resource },
        el("span", { class: "mono", text: lock.resource }),
        el("span", { class: "why", text: `${lock.owner} · ${(lock.left / 1000).toFixed(1)} s` }),
      ),
    ),
  );
  $("expiring-empty").hidden = soon.length > 0;
}

function renderAgents(locks) {
  const counts = new Map();
  for (const lock of locks) counts.set(lock.owner, (counts.get(lock.owner) || 0) + 1);
  const agents = [...counts].sort((a, b) => b[1] - a[1] || (a[0] < b[0] ? -1 : 1));
  $("agents").replaceChildren(
    ...agents.slice(0, 100).map(([owner, count]) =>
      el(
        "li",
        { "data-owner": owner },
        el("span", { text: owner }),
        el("span", { class: "why", text: agentFigures(owner) }),
        el("b", { text: String(count) }),
      ),
    ),
  );
  $("agents-empty").hidden = agents.length > 0;
  $("count-agents").textContent = agents.length;
}

function currentStep(saga) {
  const step = saga.steps.find((s) => s.status === "running" || s.status === "compensating");
  return step ? `${step.name} (${step.status})` : saga.steps.find((s) => s.status === "pending")?.name ?? "";
}

// The saga's own lease: time left by the server's clock, or the lapse the server recorded (the reaper then
// compensates the saga, or makes it stuck at the second lapse).
function sagaLease(saga) {
  if (saga.lease_lapsed_at) return `lapsed ${formatInstant(Date.parse(saga.lease_lapsed_at))}`;
  if (!saga.lease_expires_at) return "";
  const left = Math.max(0, Date.parse(saga.lease_expires_at) - serverNow());
  return `${(left / 1000).toFixed(1)} s of ${(saga.lease_ms / 1000).toFixed(0)} s`;
}

function renderSagas() {
  $("sagas").tBodies[0].replaceChildren(
    ...state.sagas.inFlight.map((saga) =>
      el(
        "tr",
        { "data-saga": saga.saga_id },
        el("td", { class: "mono", text: saga.saga_id, title: saga.saga_id }),
        el("td", { text: saga.name }),
        el("td", { text: saga.owner }),
        el("td", { text: saga.status }),
        el("td", { text: currentStep(saga) }),
        el("td", { class: saga.lease_lapsed_at ? "lease lapsed" : "lease", text: sagaLease(saga) }),
      ),
    ),
  );
  $("sagas-empty").hidden = state.sagas.inFlight.length > 0;
  $("stuck").replaceChildren(
    ...state.sagas.stuck.map((saga) =>
      el(
        "li",
        { "data-saga": saga.saga_id, class: "stack" },
        el("span", { class: "mono", text: `${saga.saga_id} · ${saga.name} · ${saga.owner}` }),
        el("span", { class: "why", text: saga.reason ?? "" }),
      ),
    ),
  );
  $("stuck-empty").hidden = state.sagas.stuck.length > 0;
}

const KINDS = [
  ["FORCE_RELEASED", "force_released"],
  ["ACQUIRED", "acquired"],
  ["RENEWED", "renewed"],
  ["HANDED_OFF", "handed_off"],
  ["RELEASED", "released"],
  ["EXPIRED", "expired"],
  ["LAPSED", "lapsed"],
  ["STUCK", "stuck"],
  ["FAILED", "failed"],
];
const kindOf = (type) => KINDS.find(([suffix]) => type.endsWith(suffix))?.[1] ?? "other";

function eventRow(at, type, resource, owner, token, extra = {}) {
  return el(
    "li",
    extra,
    el("time", { text: formatClock(at), title: new Date(at).toISOString() }),
    el("span", { class: "type", "data-kind": kindOf(type), text: type }),
    el("span", { class: "mono", text: resource, title: resource }),
    el("span", { text: owner ?? "" }),
    el("span", { class: "mono", text: token == null ? "" : `#${token}` }),
  );
}

function renderEvents() {
  let rows;
  if (state.scrub) {
    const at = state.scrub.at;
    rows = [];
    let marked = false;
    for (const change of state.scrub.changes) {
      const when = Date.parse(change.at);
      if (!marked && when > at) {
        rows.push(el("li", { class: "marker", text: `▲ ${formatInstant(at)}` }));
        marked = true;
      }
      rows.push(
        eventRow(when, change.type, change.resource, change.owner, change.fencing_token, {
          class: when > at ? "after" : "before",
        }),
      );
    }
    if (!marked) rows.push(el("li", { class: "marker", text: `▲ ${formatInstant(at)}` }));
    const { before, after, cut } = state.scrub;
    const span = (ms) => (ms >= 1000 ? `${+(ms / 1000).toFixed(1)} s` : `${Math.round(ms)} ms`);
    $("events-title").textContent =
      before === AROUND_MS && after === AROUND_MS
        ? `Events within ${span(AROUND_MS)} of that instant`
        : `Events ${span(before)} before to ${span(after)} after that instant, the nearest of a busy fleet` +
          (cut ? ` (more than ${HALF_PAGE} within ${span(MIN_AROUND_MS)} before it: the first shown)` : "");
  } else {
    rows = state.events.map((event) =>
      eventRow(Date.parse(event.recorded_at), event.type, event.stream, event.data?.owner, event.data?.fencing_token),
    );
    $("events-title").textContent = "Live events";
  }
  $("events").replaceChildren(...rows);
  $("events-empty").hidden = rows.length > 0;
}

let timeline = null;

function renderMode() {
  const scrubbed = state.scrub !== null;
  timeline?.instantMoved();
  $("banner").hidden = !scrubbed;
  // data-at and data-ready say which instant is shown and whether its answer is in (for scripts, tests).
  $("banner").dataset.at = scrubbed ? new Date(state.scrub.at).toISOString() : "";
  $("banner").dataset.ready = String(Boolean(state.scrub?.ready));
  if (scrubbed) {
    const loading = state.scrub.ready ? "" : " (loading…)";
    $("banner").textContent = `Viewing the fleet at ${formatInstant(state.scrub.at)}${loading}. Sagas and charts stay live.`;
    $("slider-label").textContent = formatInstant(state.scrub.at);
  } else {
    $("slider-label").textContent = "now (live)";
  }
  $("live").disabled = !scrubbed;
  $("held-card").classList.toggle("past", scrubbed);
  if (scrubbed) setFeedStatus("scrubbed");
  else if ($("feed-status").dataset.state === "scrubbed") setFeedStatus("live");
  placeSlider();
}

// ---- charts: bars in inline SVG ------------------------------------------------------------------------

function drawBars(id, values, unit) {
  const card = $(id);
  const svg = card.querySelector("svg");
  const max = Math.max(1, ...values);
  const width = 300 / values.length;
  const bars = values.map((value, i) => {
    const rect = document.createElementNS("http://www.w3.org/2000/svg", "rect");
    const height = (78 * value) / max;
    rect.setAttribute("x", (i * width + 0.5).toFixed(2));
    rect.setAttribute("y", (80 - height).toFixed(2));
    rect.setAttribute("width", Math.max(0.5, width - 1).toFixed(2));
    rect.setAttribute("height", height.toFixed(2));
    return rect;
  });
  svg.replaceChildren(...bars);
  const last = values[values.length - 1] ?? 0;
  card.querySelector(".chart-value").textContent = `${formatRate(last)} ${unit} now · peak ${formatRate(max)}`;
}

function renderCharts() {
  const second = Math.floor(serverNow() / 1000);
  // The last bar is the current second (minute), still filling.
  const grants = Array.from({ length: 60 }, (_, i) => state.grants.get(second - 59 + i) || 0);
  const minute = Math.floor(serverNow() / 60_000);
  const expiries = Array.from({ length: 30 }, (_, i) => state.expiries.get(minute - 29 + i) || 0);
  // One bar per read pair (every 2 s), the newest on the right.
  const conflicts = state.conflicts.map((c) => c.rate);
  drawBars("chart-grants", grants, "/s");
  drawBars("chart-conflicts", [...Array(60 - conflicts.length).fill(0), ...conflicts], "/s");
  drawBars("chart-expiries", expiries, "/min");
  prune(state.grants, second - 120);
  prune(state.expiries, minute - 60);
}

// ---- helpers -------------------------------------------------------------------------------------------

function bump(map, key) {
  map.set(key, (map.get(key) || 0) + 1);
}

function prune(map, oldest) {
  for (const key of map.keys()) if (key < oldest) map.delete(key);
}

const timers = new Map();
function soon(fn, ms) {
  if (timers.has(fn)) return;
  timers.set(
    fn,
    setTimeout(() => {
      timers.delete(fn);
      fn().catch(() => {});
    }, ms),
  );
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
const pad = (n, w = 2) => String(n).padStart(w, "0");
const formatClock = (ms) => {
  const d = new Date(ms);
  return `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
};
const formatInstant = (ms) => {
  const d = new Date(ms);
  const local = `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ${formatClock(ms)}`;
  return `${local}.${pad(d.getMilliseconds(), 3)} (${d.toISOString()})`;
};
const formatRate = (value) => (value >= 10 ? value.toFixed(0) : value.toFixed(1));

function setFeedStatus(value) {
  const pill = $("feed-status");
  if (state.scrub && value !== "scrubbed") return;
  pill.dataset.state = value;
  pill.textContent = value === "scrubbed" ? "viewing the past" : value;
}

function tick() {
  $("clock").textContent = formatClock(serverNow());
  if (!state.scrub) renderLocks();
  renderCharts();
  placeSlider();
}

function start() {
  $("token-form").addEventListener("submit", acceptToken);
  $("forget-token").hidden = !sessionStorage.getItem(TOKEN_KEY);
  $("forget-token").addEventListener("click", () => {
    sessionStorage.removeItem(TOKEN_KEY);
    location.reload();
  });
  const large = new URLSearchParams(location.search).has("large") || localStorage.getItem("lockledger.large") === "1";
  const setLarge = (on) => {
    document.documentElement.classList.toggle("large", on);
    $("large-type").setAttribute("aria-pressed", String(on));
    localStorage.setItem("lockledger.large", on ? "1" : "0");
  };
  setLarge(large);
  $("large-type").addEventListener("click", () => setLarge(!document.documentElement.classList.contains("large")));
  timeline = setUpTimeline({ api, el, now: serverNow, instant: () => state.scrub?.at ?? null });
  $("slider").addEventListener("input", onSlide);
  $("held-filter-clear").addEventListener("click", () => showReservation(null));
  $("detail-close").addEventListener("click", closeDetail);
  $("live").addEventListener("click", goLive);

  const at = Date.parse(new URLSearchParams(location.search).get("at") ?? "");
  every(LOCK_POLL_MS, pollLocks);
  every(SAGA_POLL_MS, pollSagas);
  every(STATS_POLL_MS, pollStats);
  every(STATS_POLL_MS, pollAgentStats);
  followFeed();
  setInterval(tick, 500);
  if (!Number.isNaN(at)) scrubTo(at);
  else render();
  // For scripts and tests: move the view to an instant (ms or RFC 3339), or back to live.
  window.lockledger = { scrubTo: (when) => scrubTo(typeof when === "number" ? when : Date.parse(when)), goLive };
}

start();
