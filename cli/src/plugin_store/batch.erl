%% amqp-delay import-plugin: one call into the delayed-message plugin's node (rabbitmqctl eval).
%% First deletes the entries whose copies amqp-delay confirmed, then reads the next batch of
%% pending entries in due order from a cursor. Everything is read with dirty reads (no lock, the
%% plugin's own process untouched); deletes run while the plugin's process is suspended, in
%% short Mnesia transactions that keep the table and its index in step.
%% Parameters (filled in by the tool; base64 text or integers only):
%%   Dels    base64 of the entries to delete, or <<>>: segments <<Creation:32, Words:8, Count:32,
%%           Items/binary>>, each item <<DueMs:48, RefWords/binary>> (a reference of this node
%%           rebuilt from its creation and words: 24 characters an entry, so that thousands fit
%%           the one argument rabbitmqctl eval takes)
%%   Cursor  base64(term_to_binary(LastKey)) from the previous call, or <<>> for the start
%%   Max     entries wanted (0: none, only the deletes); MaxBytes: bodies' bytes wanted
%% Output: one line "AMQPDELAY-IMPORT-1 " ++ base64(term_to_binary(Answer)):
%%   {import_batch, 1, Node, Deleted, Entries, Next, Size, Micros}
%%   Deleted  [deleted | not_found], one per requested delete, in order
%%   Entries  [{DueMs, VHost, XName, XType, RoutingKeys, PropsBin, BodyRev, Bcc, Ref}]
%%   Next     {more, CursorB64} | eof;  Size: entries the plugin holds now (after the deletes)
%% The text holds no dollar sign, backquote, backslash or tab: Debian's and Ubuntu's
%% /usr/sbin/rabbitmqctl, run as root, hands it to su ... sh -c inside double quotes, where a
%% shell would expand or eat them. So the atom of the end of a table is built from its
%% characters (36 is the dollar sign) and a newline is written 10.
Dels = <<"@DELS@">>, Cursor = <<"@CURSOR@">>, Max = @MAX@, MaxBytes = @MAXBYTES@,
T = list_to_atom("rabbit_delayed_message" ++ atom_to_list(node())),
I = list_to_atom(atom_to_list(T) ++ "_index"),
End = list_to_atom([36 | "end_of_table"]),
T0 = erlang:monotonic_time(microsecond),
%% ---- deletes: chunks of 200 in one transaction each, the plugin suspended meanwhile ----
P = whereis(rabbit_delayed_message),
Self = self(),
%% Keys of due time Due (usually one; several when exchanges share a millisecond).
KeysOf = fun KO(K, Due, Acc) ->
                 case K of
                     {delay_key, Due, _} -> KO(mnesia:dirty_next(I, K), Due, [K | Acc]);
                     _ -> Acc
                 end
         end,
DelOne = fun(Due, Ref) ->
             Keys = KeysOf(mnesia:dirty_next(I, {delay_key, Due, 0}), Due, []),
             Try = fun Tr([]) -> not_found;
                       Tr([K | Ks]) ->
                           Es = mnesia:read(T, K, write),
                           case lists:keytake(Ref, 4, Es) of
                               false -> Tr(Ks);
                               {value, _, []} ->
                                   ok = mnesia:delete({T, K}), ok = mnesia:delete({I, K}), deleted;
                               {value, _, Rest} ->
                                   ok = mnesia:delete({T, K}),
                                   [ok = mnesia:write(T, E, write) || E <- Rest],
                                   deleted
                           end
                   end,
             Try(Keys)
         end,
NodeBin = binary_part(term_to_binary(node()), 1, byte_size(term_to_binary(node())) - 1),
Refs = fun Sg(<<>>, Acc) -> lists:append(lists:reverse(Acc));
           Sg(<<Cr:32, W:8, Count:32, Rest/binary>>, Acc) ->
               Len = Count * (6 + 4 * W),
               <<Items:Len/binary, Rest2/binary>> = Rest,
               L = [{Due, binary_to_term(<<131, 90, W:16, NodeBin/binary, Cr:32, Ws/binary>>)}
                    || <<Due:48, Ws:(4 * W)/binary>> <= Items],
               Sg(Rest2, [L | Acc])
       end,
Chunk = fun(Items) ->
            %% resumes the plugin if this process dies while it is suspended
            Guard = spawn(fun() ->
                              M = monitor(process, Self),
                              receive done -> ok; {'DOWN', M, _, _, _} -> sys:resume(P) end
                          end),
            ok = sys:suspend(P),
            R = try mnesia:transaction(fun() -> [DelOne(D, R0) || {D, R0} <- Items] end)
                after sys:resume(P), Guard ! done
                end,
            case R of {atomic, Res} -> Res; {aborted, Why} -> exit({delete_aborted, Why}) end
        end,
Split = fun Sp([], Acc) -> lists:reverse(Acc);
            Sp(L, Acc) when length(L) =< 200 -> lists:reverse([L | Acc]);
            Sp(L, Acc) -> {A, B} = lists:split(200, L), Sp(B, [A | Acc])
        end,
Deleted = case Dels of
              <<>> -> [];
              _ -> lists:append([Chunk(C) || C <- Split(Refs(base64:decode(Dels), []), [])])
          end,
%% ---- read: walk the ordered index from the cursor, each key's entries by dirty_read ----
Entry = fun(Due, VH, XN, XT, {delay_entry, _, S, Ref}) ->
            {RKs, C0, Bcc} =
                case S of
                    {delivery, _, _, _, {basic_message, _, R, C, _, _}, _, _} -> {R, C, undefined};
                    _ when element(1, S) =:= mc ->
                        M = mc:convert(mc_amqpl, S),
                        {mc:routing_keys(M), mc:protocol_state(M), maps:get(bcc, element(4, M), undefined)}
                end,
            C1 = rabbit_binary_generator:ensure_content_encoded(C0, rabbit_framing_amqp_0_9_1),
            {Due, VH, XN, XT, RKs, element(4, C1), element(6, C1), Bcc, Ref}
        end,
Walk = fun W(K, _, _, Acc) when K =:= End -> {Acc, eof};
           W(K, Left, Bytes, Acc) when Left =< 0; Bytes =< 0 -> {Acc, {more, K}};
           W({delay_key, Due, X} = K, Left, Bytes, Acc) ->
               {resource, VH, exchange, XN} = element(2, X),
               XT = case rabbit_misc:table_lookup(element(7, X), <<"x-delayed-type">>) of
                        {_, Ty} -> Ty; _ -> <<>> end,
               Es = [Entry(Due, VH, XN, XT, E) || E <- mnesia:dirty_read(T, K)],
               B = lists:sum([iolist_size(element(7, E)) || E <- Es]),
               Nx = mnesia:dirty_next(I, K),
               case Nx of
                   _ when Nx =:= End -> {[Es | Acc], eof};
                   _ when Left - length(Es) =< 0; Bytes - B =< 0 -> {[Es | Acc], {more, K}};
                   _ -> W(Nx, Left - length(Es), Bytes - B, [Es | Acc])
               end
       end,
Start = case Cursor of
            <<>> -> mnesia:dirty_first(I);
            _ -> mnesia:dirty_next(I, binary_to_term(base64:decode(Cursor)))
        end,
{Acc, Next} = case Max of 0 -> {[], {more, none}}; _ -> Walk(Start, Max, MaxBytes, []) end,
Next1 = case Next of
            eof -> eof;
            {more, none} -> {more, Cursor};
            {more, LastKey} -> {more, base64:encode(term_to_binary(LastKey))}
        end,
Answer = {import_batch, 1, node(), Deleted, lists:append(lists:reverse(Acc)), Next1,
          mnesia:table_info(T, size), erlang:monotonic_time(microsecond) - T0},
io:put_chars([<<"AMQPDELAY-IMPORT-1 ">>, base64:encode(term_to_binary(Answer)), 10]),
ok.
