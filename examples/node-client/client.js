// A small client for the radixlm engine, written against docs/protocol.md only:
// a ZeroMQ DEALER socket, one msgpack map per frame, a "type" field on every message,
// replies addressed by the request's "rid".
//
//   const { Client } = require("./client");
//   const client = await Client.connect("ipc:///run/user/1000/radixlm-x/client");
//   const done = await client.generate({ text: "Hello" }, { sampling: { max_tokens: 16 } });
//   client.close();
"use strict";

const fs = require("fs");
const zmq = require("zeromq");
const { Encoder, decode } = require("@msgpack/msgpack");

const PROTOCOL_VERSION = 1;

// Omit undefined fields instead of sending nil: the engine rejects nil where a field is
// not optional (and fills in defaults for absent ones).
const encoder = new Encoder({ ignoreUndefined: true });

/** An `error` reply from the engine, with its stable `code` (docs/protocol.md). */
class EngineError extends Error {
  constructor(reply) {
    super(`${reply.code}: ${reply.message}`);
    this.name = "EngineError";
    this.code = reply.code;
    this.rid = reply.rid;
  }
}

/**
 * A key from a pyzmq `zmq.auth` certificate file (`radixlm keys` makes them):
 * `field` is "public-key" or "secret-key"; the value is Z85 text, as libzmq takes it.
 */
function certificateKey(path, field) {
  const match = fs.readFileSync(path, "utf8").match(new RegExp(`${field}\\s*=\\s*"([^"]+)"`));
  if (!match) throw new Error(`${path} has no ${field}`);
  return match[1];
}

/**
 * CurveZMQ socket options for a server started with `radixlm serve --auth-dir DIR`:
 * `serverKey` is DIR/server.key, `clientKey` this client's DIR/clients/NAME.key_secret.
 */
function curveOptions({ serverKey, clientKey } = {}) {
  if (!serverKey && !clientKey) return {};
  if (!serverKey || !clientKey) throw new Error("CurveZMQ needs both serverKey and clientKey");
  return {
    curveServerKey: certificateKey(serverKey, "public-key"),
    curvePublicKey: certificateKey(clientKey, "public-key"),
    curveSecretKey: certificateKey(clientKey, "secret-key"),
  };
}

class Client {
  /** Use `Client.connect`; the constructor does not handshake. */
  constructor(endpoint, keys = {}) {
    this.endpoint = endpoint;
    this.welcome = null;
    this._socket = new zmq.Dealer({ linger: 0, ...curveOptions(keys) });
    this._socket.connect(endpoint);
    this._pending = new Map(); // rid -> { onReply(msg) -> bool (true when finished), reject }
    this._handshake = null; // { resolve, reject } while waiting for welcome
    this._nextRid = 0;
    this._closed = false;
    this._reader = this._readLoop();
  }

  /**
   * Connect and handshake; resolves to a ready client (`client.welcome` is the Welcome).
   * `serverKey`/`clientKey`: CurveZMQ certificate files, for a server with --auth-dir.
   */
  static async connect(
    endpoint,
    { clientName = "radixlm-node-client", timeoutMs = 30000, serverKey, clientKey } = {},
  ) {
    const client = new Client(endpoint, { serverKey, clientKey });
    try {
      client.welcome = await client._hello(clientName, timeoutMs);
    } catch (err) {
      client.close();
      throw err;
    }
    return client;
  }

  close() {
    if (this._closed) return;
    this._closed = true;
    this._socket.close();
    const err = new Error("client closed");
    for (const pending of this._pending.values()) pending.reject(err);
    this._pending.clear();
  }

  _rid(kind) {
    this._nextRid += 1;
    return `${kind}-${this._nextRid}`;
  }

  async _send(msg) {
    await this._socket.send(encoder.encode(msg));
  }

  _hello(clientName, timeoutMs) {
    return new Promise((resolve, reject) => {
      const timer = setTimeout(
        () => reject(new Error(`no welcome from ${this.endpoint} within ${timeoutMs} ms`)),
        timeoutMs,
      );
      const settle = (fn) => (value) => {
        clearTimeout(timer);
        this._handshake = null;
        fn(value);
      };
      this._handshake = { resolve: settle(resolve), reject: settle(reject) };
      this._send({ type: "hello", protocol_version: PROTOCOL_VERSION, client_name: clientName })
        .catch(this._handshake.reject);
    });
  }

  async _readLoop() {
    try {
      for await (const frames of this._socket) {
        // One message per frame; a DEALER peer gets no identity or delimiter frames.
        this._dispatch(decode(frames[frames.length - 1]));
      }
    } catch (err) {
      if (!this._closed) {
        for (const pending of this._pending.values()) pending.reject(err);
        this._pending.clear();
      }
    }
  }

  _dispatch(msg) {
    if (this._handshake) {
      if (msg.type === "welcome") this._handshake.resolve(msg);
      else if (msg.type === "error") this._handshake.reject(new EngineError(msg));
      return;
    }
    const pending = msg.rid == null ? undefined : this._pending.get(msg.rid);
    if (pending === undefined) {
      // An error without a rid answers a frame the engine could not read at all.
      if (msg.type === "error") console.error(`radixlm: ${msg.code}: ${msg.message}`);
      return;
    }
    if (pending.onReply(msg)) this._pending.delete(msg.rid);
  }

  /** Send `msg` (a rid is added) and resolve with its one reply (rejects on `error`). */
  request(msg) {
    const rid = msg.rid ?? this._rid(msg.type);
    return new Promise((resolve, reject) => {
      this._pending.set(rid, {
        reject,
        onReply: (reply) => {
          if (reply.type === "error") reject(new EngineError(reply));
          else resolve(reply);
          return true;
        },
      });
      this._send({ ...msg, rid }).catch((err) => {
        this._pending.delete(rid);
        reject(err);
      });
    });
  }

  /**
   * Generate from `input` ({text} | {input_ids} | {messages, add_generation_prompt}).
   * With `onChunk`, output streams: onChunk(chunk) runs for every `chunk` in order.
   * Resolves with the `done` reply (with n > 1: an array of them, by branch index).
   * Options: sampling (with regex / json_schema / ebnf to constrain the output), session,
   * n, namespace, priority, prompt_logprobs_start, tools, tool_choice ("auto", "none",
   * "required" or {name}), rid. `done.tool_calls` holds the parsed calls.
   */
  generate(input, { onChunk, sampling, session, n = 1, namespace, priority, prompt_logprobs_start, tools, tool_choice, rid } = {}) {
    rid = rid ?? this._rid("gen");
    const msg = {
      type: "generate", rid, input, sampling, session, namespace, priority, prompt_logprobs_start,
      tools, tool_choice,
      stream: onChunk !== undefined,
      n: n === 1 ? undefined : n,
    };
    return new Promise((resolve, reject) => {
      const done = [];
      this._pending.set(rid, {
        reject,
        onReply: (reply) => {
          switch (reply.type) {
            case "chunk":
              if (onChunk) onChunk(reply);
              return false;
            case "done":
              done.push(reply);
              if (done.length < n) return false;
              done.sort((a, b) => (a.index ?? 0) - (b.index ?? 0));
              resolve(n === 1 ? done[0] : done);
              return true;
            case "error":
              reject(new EngineError(reply));
              return true;
            default:
              reject(new Error(`unexpected reply ${reply.type} to generate ${rid}`));
              return true;
          }
        },
      });
      this._send(msg).catch((err) => {
        this._pending.delete(rid);
        reject(err);
      });
    });
  }

  /** Abort an in-flight generate; it still ends with `done` (finish_reason "abort"). */
  abort(rid) {
    return this._send({ type: "abort", rid });
  }

  // --- sessions -------------------------------------------------------------------

  /** Open a session; resolves with `session_opened` ({session, length, cached_tokens}). */
  openSession({ input, pinned, retention, ttl_s, namespace } = {}) {
    return this.request({ type: "open_session", input, pinned, retention, ttl_s, namespace });
  }

  /** Fork `session` into `n` new sessions sharing its history; resolves to their ids. */
  async forkSession(session, n = 1) {
    const reply = await this.request({ type: "fork_session", session, n });
    return reply.sessions;
  }

  truncateSession(session, length) {
    return this.request({ type: "truncate_session", session, length });
  }

  closeSession(session) {
    return this.request({ type: "close_session", session });
  }

  async listSessions() {
    const reply = await this.request({ type: "list_sessions" });
    return reply.sessions;
  }

  pin(name, input, { namespace } = {}) {
    return this.request({ type: "pin", name, input, namespace });
  }

  unpin(name) {
    return this.request({ type: "unpin", name });
  }

  // --- inspection -------------------------------------------------------------------

  stats() {
    return this.request({ type: "stats" });
  }

  async tokenize(input) {
    const reply = await this.request({ type: "tokenize", input });
    return reply.input_ids;
  }

  flushCache() {
    return this.request({ type: "flush_cache" });
  }
}

module.exports = { Client, EngineError, PROTOCOL_VERSION };
